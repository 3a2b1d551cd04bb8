"""The lessons' static pages in a real headless Chromium: no script errors, no network, the JavaScript cores equal the
Python cores, every control changes the plot, and nothing overflows horizontally.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: NUL-separated JSON on fds 3/4),
so the test needs only the standard library and Debian's /usr/bin/chromium.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from lab.errors import LabError
from lab.teach import pages as pages_mod

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--remote-debugging-pipe")


def _chromium() -> str:
    for candidate in ("chromium", "chromium-browser", "/usr/bin/chromium"):
        found = shutil.which(candidate)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("headless Chromium is required in CI (apt-get install chromium) but is not on PATH")
    pytest.skip("chromium not installed (apt-get install chromium); CI runs this check")


class Browser:
    """A minimal DevTools-protocol client over Chromium's debugging pipe, one page target."""

    def __init__(self, binary: str, profile: Path):
        ours_in, theirs_out = os.pipe()  # Chromium writes fd 4 -> we read
        theirs_in, ours_out = os.pipe()  # we write -> Chromium reads fd 3
        os.set_inheritable(theirs_in, True)
        os.set_inheritable(theirs_out, True)

        def child():
            os.dup2(theirs_in, 3)
            os.dup2(theirs_out, 4)

        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     pass_fds=(3, 4, theirs_in, theirs_out), preexec_fn=child,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(theirs_in)
        os.close(theirs_out)
        self.rd, self.wr, self.buf, self.next_id, self.events = ours_in, ours_out, b"", 0, []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _read(self, timeout: float) -> dict:
        while b"\0" not in self.buf:
            ready, _, _ = select.select([self.rd], [], [], max(timeout, 0.0))
            if not ready:
                raise TimeoutError("no message from Chromium")
            chunk = os.read(self.rd, 1 << 20)
            if not chunk:
                raise EOFError("Chromium closed the pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 60.0) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self.wr, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while True:
            reply = self._read(end - time.monotonic())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def drain(self, seconds: float = 0.2) -> None:
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                self.events.append(self._read(end - time.monotonic()))
        except TimeoutError:
            pass

    def js(self, expression: str, timeout: float = 60.0):
        out = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                        session=True, timeout=timeout)
        if "exceptionDetails" in out:
            raise RuntimeError(out["exceptionDetails"].get("exception", {}).get("description", out["exceptionDetails"]))
        return out["result"].get("value")

    def open(self, url: str, width: int = 1280, height: int = 900) -> None:
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)
        self.events.clear()
        self.call("Page.navigate", {"url": url}, session=True)
        end = time.monotonic() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._read(end - time.monotonic()))
        self.wait_for("window.Bokeh && Bokeh.documents.length > 0 && Object.keys(Bokeh.index).length > 0 && "
                      "document.querySelector('.bk-Column, .bk-root, [class^=bk]') !== null")
        self.drain(0.3)

    def wait_for(self, expression: str, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while not self.js(f"Boolean({expression})"):
            if time.monotonic() > end:
                raise TimeoutError(f"page never satisfied {expression}")
            time.sleep(0.05)

    def errors(self) -> list[str]:
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(d.get("exception", {}).get("description") or d.get("text"))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(p["entry"]["text"])
        return out

    def requests(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def screenshot(self) -> bytes:
        import base64

        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, EOFError, OSError):
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        os.close(self.rd)
        os.close(self.wr)


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
    browser.open((built / f"{page.slug}.html").as_uri())
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
        browser.open((built / f"{page.slug}.html").as_uri(), width=width)
        overflow = browser.js("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"{page.slug}: {overflow}px horizontal overflow at width {width}"
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
