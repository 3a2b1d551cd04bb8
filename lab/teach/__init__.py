"""Teaching lessons on off-policy variance: numpy cores, figures, live controls, exercises and static pages.

One module per idea, each a set of pure functions with the formulas and sources in its docstring:

    weight_explosion  why sequence importance weights explode with length (ESS, chi2 against T and per-token KL)
    clip_mask         what PPO clipping, TIS, IcePop masking, CISPO and SAPO throw away (mass and direction)
    vespo_kernel      VESPO's kernel as a proposal between mu and pi, and Proposition 3.1's bound
    gvpo_zero_sum     GVPO's zero-sum weights: why Z(x) cancels, and the optimum from off-policy samples
    vopd_baseline     vOPD's baseline -KL_t: unbiased, and when it does and does not lower the variance
    sampler_truncation  top-p / top-k / min-p: the ratio averages the kept mass, mask replay, the two truths

Shared pieces: ``tokens`` (a next-token distribution and a stale behaviour at a chosen KL), ``hashrng`` (random
draws reproducible in JavaScript), ``exercises`` (checked answers), ``plots`` (matplotlib figures), ``live``
(ipywidgets controls), ``jscore`` and ``pages`` (the static browser pages: ``python -m lab.teach.pages DIR``).

``LESSONS`` lists the teaching notebooks with a one-line description and small parameters for smoke runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Lesson:
    name: str  # report name
    notebook: str  # path relative to the repository root
    description: str
    smoke: dict = field(default_factory=dict)  # small parameters for test runs (papermill)

    @property
    def page(self) -> str:
        """The slug of the lesson's static page (``lab.teach.pages``)."""
        return self.name.removeprefix("teach_")

    @property
    def module(self) -> str:
        """The lesson's module, whose ``Config`` holds its parameters."""
        return f"lab.teach.{self.page}"


LESSONS = (
    Lesson("teach_weight_explosion", "notebooks/teach/01_weight_explosion.ipynb",
           "Lesson: why sequence importance weights explode with length, ESS and chi2 against T and the per-token "
           "KL, and why a batch's own ESS is optimistic.",
           {"kls": [0.01, 0.2], "lengths": [1, 16, 256], "replicates": 2, "batch": 64}),
    Lesson("teach_clip_mask", "notebooks/teach/02_clip_mask.ipynb",
           "Lesson: what PPO clipping, TIS, IcePop masking, CISPO and SAPO throw away, the mass and the direction of "
           "the gradient they drop.",
           {"vocab": 16, "kls": [0.05, 0.5]}),
    Lesson("teach_vespo_kernel", "notebooks/teach/03_vespo_kernel.ipynb",
           "Lesson: VESPO's kernel as an implicit proposal between mu and pi, and its variance bound "
           "(Proposition 3.1) checked exactly.",
           {"kernels": [[2.0, 3.0], [3.0, 2.0], [0.5, 1.0]], "kls": [0.1], "lengths": [2], "seeds": [0],
            "length": 3}),
    Lesson("teach_gvpo_zero_sum", "notebooks/teach/04_gvpo_zero_sum.ipynb",
           "Lesson: GVPO's zero-sum weights, why the partition function cancels, and the KL-regularised optimum "
           "reached from off-policy samplers.",
           {"steps": 40, "sampled_steps": 10}),
    Lesson("teach_vopd_baseline", "notebooks/teach/05_vopd_baseline.ipynb",
           "Lesson: vOPD's baseline -KL_t, why it is unbiased, and where it lowers or raises the variance of "
           "on-policy distillation.",
           {"vocabs": [3, 32], "draws": 40, "settings": [[1.0, 0.0]], "mc_samples": 300}),
    Lesson("teach_sampler_truncation", "notebooks/teach/06_sampler_truncation.ipynb",
           "Lesson: what a top-p, top-k or min-p sampler does to the trainer's ratio (it averages the kept mass), "
           "what mask replay fixes, and the one-token update's bias against the full and the deployed policy.",
           {"vocab": 16, "top_ps": [1.0, 0.8, 0.5], "batch": 256}),
)
