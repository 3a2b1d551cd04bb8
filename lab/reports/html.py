"""A built report's page: the executed notebook as self-contained HTML (outputs only, images inline, no scripts or
remote resources, no progress or warning streams), with its provenance and run files at the top."""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

from lab.inputs import load_json
from lab.runs import RUN_FILES

NOTEBOOK_BYTES = 512 << 20  # an executed notebook with its figures (read back for the gallery, bounded)
NOTEBOOK_NODES = 10_000_000

_WIDGET = "application/vnd.jupyter.widget-view+json"
_SCRIPTS = re.compile(r"<script\b.*?</script>", re.I | re.S)  # MathJax, require.js, mermaid: all from CDNs
_REMOTE_LINKS = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>", re.I)
_CSS = """<style>
body { max-width: 1180px; margin: 0 auto !important; padding: 0 24px 48px; }
.jp-Notebook { padding: 8px 0 !important; }
.jp-RenderedHTMLCommon table.lab-headline { font-size: 13px; }
.jp-RenderedImage img { max-width: 100%; height: auto; }
.lab-provenance { color: #666; font: 12px system-ui, sans-serif; padding: 10px 0; border-bottom: 1px solid #eee;
                  overflow-wrap: anywhere; }
</style>
"""


def export_html(notebook: Path, title: str) -> str:
    """Self-contained HTML of an executed notebook: outputs only, images inline, no scripts or remote resources.
    Streams written to stderr (progress bars, warnings) stay in the notebook file, not on the page."""
    import nbformat
    from bs4 import BeautifulSoup
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook), as_version=4)
    for cell in nb.cells:
        outputs = cell.get("outputs", [])
        outputs[:] = [o for o in outputs if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
        for out in outputs:
            data = out.get("data", {})
            if _WIDGET in data and ({"text/html", "image/png"} & set(data)):
                del data[_WIDGET]  # a static page has no widget state: show the output's static fallback instead
    exporter = HTMLExporter(template_name="lab", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    exporter.log.setLevel("ERROR")  # it warns about missing alt text, which is added below
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    body = _REMOTE_LINKS.sub("", _SCRIPTS.sub("", body))  # a report is static: tables, text, PNGs
    soup = BeautifulSoup(body, features="html.parser")
    images = [img for img in soup.select("img") if img.get("src", "").startswith("data:image/png")]
    for img, alt in zip(images, figure_alts(nb)):
        if alt and (not img.get("alt") or img["alt"].startswith("No description")):
            img["alt"] = alt
    return str(soup).replace("</head>", _CSS + "</head>", 1)


def figure_alts(nb) -> list[str]:
    """One alt text per PNG output, in order: the line starting "*Figure:" of the nearest Markdown cell above it,
    else that cell's first sentence (the notebooks describe each figure just before drawing it)."""
    alts, text = [], ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            src = cell.source.strip()
            marked = [line.strip("* ") for line in src.splitlines() if line.lstrip("*").startswith("Figure:")]
            text = marked[0] if marked else re.split(r"(?<=[.!?])\s", re.sub(r"[#*`]", "", src).strip(), 1)[0]
        for out in cell.get("outputs", []):
            if "image/png" in out.get("data", {}):
                alts.append(text)
    return alts


def stamp(html_text: str, folder: Path, name: str, page: str = "") -> str:
    """The report page with its provenance and links to its run files at the top."""
    line = (f'<div class="lab-provenance">{html.escape(provenance_line(provenance(folder, name)))}<br>'
            f'files: {file_links(name, page)} · <a href="../index.html">all reports</a></div>')
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + line, html_text, count=1)


def provenance(folder: Path, name: str) -> dict:
    """When and from what a built report came: date, lab version, git revision and the parameters it was given
    (those that differ from the report's defaults)."""
    out = {"date": "", "version": "", "revision": "", "parameters": {}}
    try:
        config = load_json(folder / "config.json", "run config")
        out["version"] = str((config.get("versions") or {}).get("offpolicy-variance-lab") or "")
        out["revision"] = str(config.get("git_revision") or "")[:12]
        nb = load_json(folder / f"{name}.ipynb", "notebook", NOTEBOOK_BYTES, max_nodes=NOTEBOOK_NODES)
        meta = nb.get("metadata", {})
        out["date"] = str(meta.get("papermill", {}).get("end_time") or "")[:16].replace("T", " ")
        out["parameters"] = dict(meta.get("lab", {}).get("given") or {})
    except (OSError, ValueError, AttributeError, TypeError):  # LabError included: a folder edited by hand
        pass
    return out


def provenance_line(prov: dict) -> str:
    params = ", ".join(f"{k}={json.dumps(v)}" for k, v in prov["parameters"].items()) or "defaults"
    return (f"built {prov['date'] or '?'} UTC · lab {prov['version'] or '?'} · revision {prov['revision'] or '?'} · "
            f"parameters: {params}")


def file_links(name: str, page: str = "", prefix: str = "") -> str:
    files = [f"{name}.ipynb", *RUN_FILES, *([f"{page}.html"] if page else [])]
    return " · ".join(f'<a href="{prefix}{html.escape(f)}">{html.escape(f)}</a>' for f in files)


def thumbnail(notebook: Path) -> str | None:
    """The first PNG output of an executed notebook, base64."""
    try:
        for cell in load_json(notebook, "notebook", NOTEBOOK_BYTES, max_nodes=NOTEBOOK_NODES)["cells"]:
            for out in cell.get("outputs", []):
                png = out.get("data", {}).get("image/png")
                if png:
                    return "".join(png).strip()
    except (OSError, ValueError, KeyError, AttributeError, TypeError):  # LabError included: not a notebook
        return None
    return None
