"""A real browser for the console's tests: Debian's headless Chromium driven over the DevTools
protocol (python3-websocket), with nothing from pip. The page is loaded and clicked as a person
would (mouse events at a button's place on the screen), its console errors, exceptions and CSP
reports are collected, and screenshots are taken."""

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request

import pytest

websocket = pytest.importorskip("websocket", reason="python3-websocket (scripts/deps.sh)")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    def __init__(self, ws_url):
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events = []
        for domain in ("Page", "Runtime", "Log"):
            self.call(domain + ".enable")

    def call(self, method, **params):
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def eval(self, expression):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression, timeout=20, what=None):
        deadline = time.monotonic() + timeout
        while True:
            v = self.eval(f"!!({expression})")  # a DOM node comes back as {}
            if v:
                return v
            if time.monotonic() > deadline:
                self.drain()
                text = self.eval("document.body ? document.body.innerText : ''")
                raise AssertionError(f"timed out waiting for {what or expression}; the page "
                                     f"says:\n{text[:3000]}\nproblems: {self.problems()}")
            time.sleep(0.2)

    def open(self, url, width=1280, height=900, mobile=False, scale=1):
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=scale, mobile=mobile)
        self.call("Page.navigate", url=url)
        self.wait("document.readyState === 'complete'", what="the page loaded")

    def click(self, selector):
        """A left click where the element is on the screen (scrolled into view first)."""
        box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            if (!e) return null; e.scrollIntoView({{block: 'center'}});
            const r = e.getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2, e.disabled]; }})()""")
        assert box is not None, f"nothing on the page matches {selector}"
        assert not box[2], f"{selector} is disabled"
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left",
                      clickCount=1)

    def type_into(self, selector, text):
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def screenshot(self, path, full=True):
        params = {"format": "png"}
        if full:
            m = self.call("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m["contentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"],
                              "scale": 1}
            params["captureBeyondViewport"] = True
        data = base64.b64decode(self.call("Page.captureScreenshot", **params)["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

    def problems(self):
        """Exceptions, console errors and CSP violations the page reported."""
        out = []
        for e in self.events:
            m, p = e["method"], e.get("params", {})
            if m == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:500])
            elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append("log: " + p["entry"].get("text", ""))
            elif m == "Runtime.consoleAPICalled" and p.get("type") == "error":
                out.append("console: " + json.dumps(p.get("args"))[:500])
        return out

    def drain(self):
        """Reads the events that arrived while nothing was being called."""
        self.ws.settimeout(0.2)
        with contextlib.suppress(Exception):
            while True:
                msg = json.loads(self.ws.recv())
                if "method" in msg:
                    self.events.append(msg)
        self.ws.settimeout(30)

    def close(self):
        with contextlib.suppress(Exception):
            self.ws.close()


class Browser:
    def __init__(self, workdir):
        if CHROMIUM is None:
            raise AssertionError("chromium is not installed (scripts/deps.sh)")
        self.profile = tempfile.mkdtemp(prefix="chromium-", dir=workdir)
        self.log = open(os.path.join(workdir, "chromium.log"), "w+")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--remote-debugging-port=0", "--no-sandbox",
             "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-sync",
             "--disable-background-networking", "--disable-component-update",
             "--hide-scrollbars", f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.log)
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            self.log.seek(0)
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", self.log.read())
            if m:
                port = int(m.group(1))
            elif self.proc.poll() is not None:
                break
            else:
                time.sleep(0.1)
        if port is None:
            self.log.seek(0)
            self.close()
            raise AssertionError(f"chromium did not start:\n{self.log.read()[-3000:]}")
        self.port = port

    def page(self):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank",
                                     method="PUT")
        with urllib.request.urlopen(req, timeout=30) as r:
            target = json.loads(r.read())
        return Page(target["webSocketDebuggerUrl"])

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture
def browser(tmp_path):
    b = Browser(str(tmp_path))
    yield b
    b.close()
