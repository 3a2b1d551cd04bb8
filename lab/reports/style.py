"""What every report shares: one colour per estimator, interval formatting, table styling.

Colours follow the registry order, so an estimator keeps its colour in every report and figure; variants of an
estimator (``vopd_top8``, ``opd_rtg``, and the registry's own ``vopd_topk`` and ``kl_topk``) take their family's
variant colour.
"""
from __future__ import annotations

import matplotlib
import pandas as pd

from lab import estimators

# every report figure at 150 dpi (figures are built without pyplot and rendered by the notebook's display hook)
matplotlib.rcParams["figure.dpi"] = 150

# distinguishable colours: tab10, then the shades of tab20, tab20b and tab20c (one per registered estimator)
_PALETTE = [
    "#7f7f7f", "#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#2ca02c", "#1f77b4",
    "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363",
    "#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#ad494a", "#a55194", "#b5cf6b", "#e7ba52", "#ce6dbd", "#6b6ecf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5",
    "#5254a3", "#9c9ede", "#8ca252", "#cedb9c", "#bd9e39", "#e7cb94", "#d6616b", "#e7969c", "#de9ed6", "#9ecae1",
    "#c6dbef", "#fdae6b", "#fdd0a2", "#a1d99b", "#c7e9c0", "#bcbddc", "#dadaeb", "#969696", "#bdbdbd", "#d9d9d9",
]
_PINNED = {"reinforce": "#7f7f7f", "seq_is": "#d62728", "token_is": "#9467bd", "ppo_clip": "#ff7f0e",
           "vespo": "#1f77b4", "gvpo": "#2ca02c", "opd": "#636363", "vopd": "#3182bd", "kl_full": "#31a354"}
_VARIANTS = {"opd_rtg": "#9e9ac8", "vopd_top": "#6baed6", "kl_top": "#74c476"}


def _registry_colors() -> dict[str, str]:
    free = [c for c in _PALETTE if c not in set(_PINNED.values()) | set(_VARIANTS.values())]
    out, i = {}, 0
    for name in estimators.names():
        variant = [c for prefix, c in _VARIANTS.items() if name.startswith(prefix)]
        if name in _PINNED or variant:
            out[name] = _PINNED.get(name) or variant[0]
        else:
            out[name] = free[i % len(free)]
            i += 1
    return out


ESTIMATOR_COLORS = _registry_colors()


def color(name: str) -> str:
    """The colour of an estimator (or of a variant label such as vopd_top8); grey for anything unknown."""
    if name in ESTIMATOR_COLORS:
        return ESTIMATOR_COLORS[name]
    for prefix, c in _VARIANTS.items():
        if name.startswith(prefix):
            return c
    return "#555555"


def interval(value, lo, hi, fmt: str = "{:.3g}") -> str:
    """'v [lo, hi]' with one format for all three."""
    return f"{fmt.format(value)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def table(df: pd.DataFrame, caption: str, highlight: dict | None = None, text: tuple = ()):
    """A pandas Styler with the lab's table look: no index, right-aligned cells, caption on top; ``highlight``
    maps row positions to the columns to mark (bold on green); ``text`` names columns of prose, shown in full,
    left-aligned and wrapped."""
    styled = df.style.hide(axis="index")
    if highlight:
        marks = pd.DataFrame("", index=df.index, columns=df.columns)
        for i, cols in highlight.items():
            for c in cols:
                marks.iloc[i, df.columns.get_loc(c)] = "font-weight: bold; background-color: #e3f4e1"
        styled = styled.apply(lambda _: marks, axis=None)
    prose = "text-align: left; min-width: 8em; overflow-wrap: anywhere;"
    return (styled.set_table_attributes('class="lab-headline"').set_caption(caption)
            .set_table_styles([{"selector": "caption", "props": "caption-side: top; text-align: left; color: #555;"},
                               {"selector": "td, th", "props": "text-align: right; padding: 3px 10px;"}])
            .set_table_styles({c: [{"selector": "td, th", "props": prose}] for c in text}, overwrite=False))
