"""A headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: NUL-separated JSON on
fds 3/4), so the browser tests need only the standard library and Debian's /usr/bin/chromium."""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

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

    def open(self, url: str, width: int = 1280, height: int = 900, ready: str | None = None) -> None:
        """Load ``url`` and wait for its load event, then for the JavaScript expression ``ready`` if given."""
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=True)
        self.events.clear()
        self.call("Page.navigate", {"url": url}, session=True)
        end = time.monotonic() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._read(end - time.monotonic()))
        if ready:
            self.wait_for(ready)
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


# Elements wider than their box: they scroll sideways (overflow-x auto/scroll), spill out (visible) or are clipped
# (hidden/clip); and table cells cut short with "..." (pandas' max_colwidth, or rows/columns left out).
LAYOUT_PROBLEMS = """(() => {
  const name = (e) => e.tagName.toLowerCase() + (e.id ? "#" + e.id : "") +
    (typeof e.className === "string" && e.className.trim() ? "." + e.className.trim().split(/\\s+/).join(".") : "");
  const out = [];
  for (const e of document.querySelectorAll("body *")) {
    if (e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1) {
      out.push(`${name(e)} is ${e.scrollWidth} px wide in a ${e.clientWidth} px box ` +
               `(overflow-x ${getComputedStyle(e).overflowX}): ${e.innerText.trim().slice(0, 60)}`);
    }
  }
  for (const c of document.querySelectorAll("td, th")) {
    const text = c.textContent.trim();
    if (text.endsWith("...") || text.endsWith("\\u2026")) out.push(`table cell cut short: ${text.slice(-60)}`);
  }
  return out;
})()"""


def layout_problems(browser: Browser) -> list[str]:
    """What on the open page scrolls sideways, is clipped, or is cut short with an ellipsis."""
    return browser.js(LAYOUT_PROBLEMS)
