"""The lessons' static pages in a real headless Chromium: no script errors, no network, the JavaScript cores equal the
Python cores, every control changes the plot, and nothing overflows horizontally.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: NUL-separated JSON on fds 3/4),
so the test needs only the standard library and Debian's /usr/bin/chromium.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from lab.errors import LabError
from lab.teach import pages as pages_mod

from browser import Browser, _chromium  # noqa: E402  (tests/browser.py)

BOKEH_READY = ("window.Bokeh && Bokeh.documents.length > 0 && Object.keys(Bokeh.index).length > 0 && "
               "document.querySelector('.bk-Column, .bk-root, [class^=bk]') !== null")


pytestmark = pytest.mark.slow  # a headless browser and every page built


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pages")
    paths = pages_mod.build_pages(out)
    assert [p.name for p in paths] == [f"{p.slug}.html" for p in pages_mod.pages()] + ["index.html"]
    return out


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(_chromium(), tmp_path_factory.mktemp("profile"))
    yield b
    b.close()


def _close(a, b, path="") -> list[str]:
    """Recursive comparison of the JavaScript and Python page data; returns the mismatching paths."""
    if isinstance(b, dict):
        return [m for k in b for m in _close(a.get(k) if isinstance(a, dict) else None, b[k], f"{path}.{k}")]
    if b is None or isinstance(b, str):
        return [] if a == b else [path]
    x = np.asarray(a if a is not None else np.nan, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        return [f"{path} shape {x.shape} != {y.shape}"]
    ok = np.isclose(x, y, rtol=1e-7, atol=1e-10) | (np.isnan(x) & np.isnan(y))
    return [] if ok.all() else [f"{path}: js {x[~ok][:3]} py {y[~ok][:3]}"]


def test_pages_are_self_contained(built):
    for page in pages_mod.pages():
        text = (built / f"{page.slug}.html").read_text(encoding="utf-8")
        # no external script, stylesheet or image tags (BokehJS's code mentions CDN URLs for features these pages do
        # not use; the headless test below checks that nothing is requested)
        assert not re.search(r"<script\b[^>]*\bsrc\s*=", text, re.I)
        assert not re.search(r"<(link|img)\b[^>]*\b(href|src)\s*=\s*[\"']?(https?:)?//", text, re.I)
        assert "window.TeachCore" in text and page.title in text
        assert 1_000_000 < len(text) < 4_000_000  # BokehJS inline, not a CDN link


def test_build_refuses_unknown_lessons_and_files(tmp_path):
    with pytest.raises(LabError, match="unknown lesson"):
        pages_mod.build_pages(tmp_path, ["nope"])
    (tmp_path / "f").write_text("x")
    with pytest.raises(LabError, match="not a folder"):
        pages_mod.build_pages(tmp_path / "f")


@pytest.mark.parametrize("page", pages_mod.pages(), ids=lambda p: p.slug)
def test_page_in_headless_chromium(built, browser, page):
    browser.open((built / f"{page.slug}.html").as_uri(), ready=BOKEH_READY)
    assert browser.errors() == []
    names = ", ".join(repr(n) for n in page.sources)
    read = f"(() => {{ const doc = Bokeh.documents[0]; return Object.fromEntries([{names}].map((n) => " \
           f"[n, JSON.stringify(doc.get_model_by_name(n).data)])); }})()"

    # 1. the JavaScript core reproduces the Python core: at load (the ready callback redrew the plots) and directly
    loaded = browser.js(read)
    assert all(loaded.values())
    assert "n/a" not in browser.js("Bokeh.documents[0].get_model_by_name('numbers').text")
    for params in (page.params, {**page.params, **{k: v for k, v in page.controls.items() if k in page.params}}):
        js = browser.js(f"TeachCore.{page.lesson}.pageData({json.dumps(params)}, {json.dumps(page.grids)})")
        assert _close(js, page.python(params)) == [], page.slug

    # 2. every control changes the plotted data and the picture
    before_png = browser.screenshot()
    for name, value in page.controls.items():
        before = browser.js(read)
        browser.js(f"Bokeh.documents[0].get_model_by_name({json.dumps(name)}).value = {json.dumps(value)}")
        after = browser.js(read)
        assert after != before, f"{page.slug}: control {name} did not change the plot"
    assert browser.screenshot() != before_png
    browser.drain(0.2)
    assert browser.errors() == []

    # 3. a real keyboard press on the first slider's handle moves it and redraws
    before = browser.js(read)
    handle = """(() => { const walk = (root) => { for (const el of root.querySelectorAll('*')) {
        if (el.classList && el.classList.contains('noUi-handle')) return el;
        if (el.shadowRoot) { const h = walk(el.shadowRoot); if (h) return h; } } return null; };
      const h = walk(document); if (!h) return false; h.focus(); return true; })()"""
    assert browser.js(handle), "no slider handle found"
    for kind in ("keyDown", "keyUp"):
        browser.call("Input.dispatchKeyEvent", {"type": kind, "key": "ArrowRight", "code": "ArrowRight",
                                                "windowsVirtualKeyCode": 39}, session=True)
    browser.drain(0.3)
    assert browser.js(read) != before, f"{page.slug}: the keyboard did not move the slider"

    # 4. nothing from the network, no horizontal overflow at desktop and phone widths
    assert [u for u in browser.requests() if not u.startswith(("file:", "data:", "blob:", "about:"))] == []
    for width in (1280, 420):
        browser.open((built / f"{page.slug}.html").as_uri(), width=width, ready=BOKEH_READY)
        overflow = browser.js("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"{page.slug}: {overflow}px horizontal overflow at width {width}"
        assert browser.errors() == []


def test_truncation_page_equals_python_for_every_sampler(built, browser):
    """The sampler-truncation core in the browser against Python for every kind, staleness and temperature, and the
    knob's slider following the kind (range, integer steps for top-k, its starting value)."""
    page = next(p for p in pages_mod.pages() if p.slug == "sampler_truncation")
    browser.open((built / f"{page.slug}.html").as_uri(), ready=BOKEH_READY)
    for kind, level in (("top_p", 0.55), ("top_k", 1), ("top_k", 5), ("top_k", 64), ("min_p", 0.0), ("min_p", 0.3)):
        for kl, temperature, seed in ((0.0, 1.0, 0), (0.3, 0.6, 7)):
            params = {**page.params, "kind": kind, "level": level, "kl": kl, "temperature": temperature, "seed": seed}
            js = browser.js(f"TeachCore.samplerTruncation.pageData({json.dumps(params)}, {json.dumps(page.grids)})")
            assert _close(js, page.python(params)) == [], (kind, level, kl, temperature)
    model = "Bokeh.documents[0].get_model_by_name"
    for kind in ("top_k", "min_p", "top_p"):
        browser.js(f"{model}('kind').value = {json.dumps(kind)}")
        got = browser.js(f"(() => {{ const s = {model}('level'); return [s.start, s.end, s.step, s.value]; }})()")
        r = page.grids["ranges"][kind]
        assert got == [r["start"], r["end"], r["step"], r["value"]], kind
        assert browser.js(f"{model}('numbers').text").count(page.grids["titles"][kind].split()[0]) >= 1
    assert browser.errors() == []


def test_index_links_every_page(built):
    index = (built / "index.html").read_text()
    for page in pages_mod.pages():
        assert f'href="{page.slug}.html"' in index


def test_command_builds_pages(tmp_path, capsys):
    """``python -m lab.teach.pages DIR [--only ...]`` (its main(), in this process)."""
    assert pages_mod.main([str(tmp_path / "out"), "--only", "vopd_baseline"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["index.html", "vopd_baseline.html"]
    assert capsys.readouterr().out.startswith("wrote 1 page and")
    assert pages_mod.main([str(tmp_path / "o2"), "--only", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown lesson")
    assert not (tmp_path / "o2").exists()
