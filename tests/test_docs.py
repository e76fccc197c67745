"""The documentation site: every public name has a reference page, the build is clean, pages load.

* The reference lists (``docs/api/*.rst``) name every entry of ``jaxopt_dist.__all__`` and of the
  Flax front ends' ``__all__`` exactly once: read from the sources, no build needed.
* A Sphinx build with warnings as errors (notebooks not executed), where Sphinx is installed.
* A headless Chromium opens pages of the built site, served over HTTP, and finds no failed
  request, no HTTP error, no JavaScript error and no raw TeX (``\\(`` or ``\\[`` as text: MathJax,
  served by the site itself, typesets every formula without a network). The site is ``docs/_build/html`` (the README's
  build command) or ``$JAXOPT_DIST_DOCS_HTML``; the test is skipped without Chromium or a site
  (and fails instead with ``JAXOPT_DIST_DOCS_STRICT=1``, as in CI).
"""

from __future__ import annotations

import ast
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests import helpers

DOCS = helpers.ROOT / "docs"
API = DOCS / "api"
PUBLIC_MODULES = {
    "jaxopt_dist": helpers.ROOT / "jaxopt_dist" / "__init__.py",
    "jaxopt_dist.nnx": helpers.ROOT / "jaxopt_dist" / "nnx.py",
    "jaxopt_dist.linen": helpers.ROOT / "jaxopt_dist" / "linen.py",
    "jaxopt_dist.islands": helpers.ROOT / "jaxopt_dist" / "islands.py",
}
# The pages the browser opens: the landing page, a guide, an API page.
PAGES = ("index.html", "guides/choosing.html", "api/generated/jaxopt_dist.diloco.html")


def _all_names(path: Path) -> list[str]:
    """The ``__all__`` tuple of a module, read from its source (the Flax faces need no flax)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"no __all__ in {path}")


def _documented_names() -> list[str]:
    """Every ``module.name`` listed in an autosummary directive of docs/api/*.rst."""
    names = []
    for path in sorted(API.glob("*.rst")):
        module, listing = None, False
        for line in path.read_text().splitlines():
            if m := re.match(r"\.\. currentmodule:: (\S+)", line):
                module = m.group(1)
            elif line.startswith(".. autosummary::"):
                listing = True
            elif listing and (not line.strip() or line.strip().startswith(":")):
                continue
            elif listing and line.startswith("   "):
                assert module is not None, f"{path.name}: autosummary before any currentmodule"
                names.append(f"{module}.{line.strip()}")
            else:
                listing = False
    return names


def test_every_public_name_has_a_reference_page():
    documented = _documented_names()
    public = [f"{mod}.{n}" for mod, path in PUBLIC_MODULES.items() for n in _all_names(path)]
    assert len(public) >= 108
    assert sorted(set(public) - set(documented)) == [], "public names without a page in docs/api"
    assert sorted(set(documented) - set(public)) == [], "pages in docs/api for names that are not public"
    twice = sorted({n for n in documented if documented.count(n) > 1})
    assert twice == [], "names listed on two pages"


def test_reference_pages_are_in_the_toctree():
    index = (API / "index.rst").read_text()
    for path in API.glob("*.rst"):
        if path.name != "index.rst":
            assert re.search(rf"^   {path.stem}$", index, flags=re.MULTILINE), path.name


def test_relative_links_resolve_in_the_checkout():
    """The README and the pages are readable as Markdown in a checkout: every relative link there names a
    file of the checkout (the build points links to ``notebooks/`` at the site's rendered copies)."""
    pages = [helpers.ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links, not code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z]+:", path):
                continue
            file = (
                page.parent / path
            ).resolve()  # docs/notebooks/ holds the build's copies, not files of the checkout
            if not file.exists() or file.is_relative_to(DOCS / "notebooks"):
                broken.append(f"{page.relative_to(helpers.ROOT)}: {target}")
    assert not broken, broken


@pytest.mark.slow
def test_sphinx_build_has_no_warnings(tmp_path):
    """The README's build command (``-W --keep-going``) without executing the notebooks."""
    pytest.importorskip("sphinx", reason="Sphinx is not installed (pip install -e '.[docs]')")
    pytest.importorskip("myst_nb", reason="myst-nb is not installed (pip install -e '.[docs]')")
    env = helpers.child_env(devices=8)
    env["JAXOPT_DIST_DOCS_EXECUTE"] = "off"
    cmd = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "html",
        "-d",
        str(tmp_path / "doctrees"),
    ]
    run = subprocess.run(
        [*cmd, str(DOCS), str(tmp_path / "html")], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stderr[-6000:]
    assert (tmp_path / "html" / "api" / "generated" / "jaxopt_dist.diloco.html").exists()


# -- The browser test: Chromium over the DevTools protocol ---------------------------------------------


def _skip(reason: str):
    """Skips the browser test; CI (``JAXOPT_DIST_DOCS_STRICT=1``) fails instead."""
    if os.environ.get("JAXOPT_DIST_DOCS_STRICT") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site quietly, remembering every request that was not answered 200/304."""

    errors: list[str]

    def log_message(self, format, *args):
        pass

    def log_request(self, code="-", size="-"):
        if str(getattr(code, "value", code)) not in ("200", "304"):
            self.errors.append(f"{code} {self.path}")


@pytest.fixture
def site():
    """The built site served over HTTP on a free port: (base URL, server-side errors)."""
    root = Path(os.environ.get("JAXOPT_DIST_DOCS_HTML", DOCS / "_build" / "html"))
    if not (root / "index.html").exists():
        _skip(f"no built site at {root} (sphinx-build -W --keep-going -b html docs docs/_build/html)")
    errors: list[str] = []
    handler = type("Handler", (_Handler,), {"errors": errors})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", errors
    finally:
        server.shutdown()
        server.server_close()


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    _skip("Chromium is not installed (apt-get install -y chromium)")


class _DevTools:
    """A headless Chromium and one page of it, driven over the DevTools protocol."""

    def __init__(self, binary: str, profile: Path):
        try:
            import websocket
        except ImportError:
            _skip("websocket-client is not installed (pip install -e '.[docs]')")
        args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
        ]
        args += ["--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"]
        self.log = profile.with_suffix(".log")  # a file, not a pipe: Chromium never blocks on it
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([binary, *args], stdout=log, stderr=log)
        self.ws = websocket.create_connection(self._browser_url(), timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _browser_url(self) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.proc.poll() is None:
            if m := re.search(r"DevTools listening on (ws://\S+)", self.log.read_text()):
                return m.group(1)
            time.sleep(0.1)
        self.close()
        raise AssertionError("Chromium did not start:\n" + self.log.read_text()[-3000:])

    def call(self, method: str, *, session: bool = False, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self.next_id:
                assert "error" not in reply, (method, reply["error"])
                return reply.get("result", {})
            self.events.append(reply)

    def open(self, url: str, settle: float = 2.0) -> list[dict]:
        """Loads ``url``; returns the page's events until ``settle`` seconds after its load event."""
        self.events = []
        self.call("Page.navigate", session=True, url=url)
        deadline, loaded = time.monotonic() + 60, None
        while time.monotonic() < (loaded or deadline):
            self.ws.settimeout(max(0.05, (loaded or deadline) - time.monotonic()))
            try:
                event = json.loads(self.ws.recv())
            except Exception as e:  # the socket's timeout: nothing more arrived
                if type(e).__name__ != "WebSocketTimeoutException":
                    raise
                continue
            self.events.append(event)
            if event.get("method") == "Page.loadEventFired" and loaded is None:
                loaded = time.monotonic() + settle
        assert loaded is not None, f"{url} did not finish loading"
        self.ws.settimeout(30)
        return self.events

    def close(self):
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _problems(events: list[dict], base: str) -> list[str]:
    """Failed requests, HTTP errors, console errors and uncaught exceptions among a page's events.

    A request outside the site (a CDN's MathJax, say) that fails is not counted: the site is
    built and browsed offline. Every script error counts, wherever it comes from.
    """
    urls, problems = {}, []

    def failed(url: str, what: str):
        if url.startswith(base):
            problems.append(f"{what}: {url}")

    for event in events:
        method, p = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            urls[p["requestId"]] = p["request"]["url"]
        elif method == "Network.loadingFailed" and not p.get("canceled"):
            failed(urls.get(p["requestId"], base + "?"), f"request failed ({p.get('errorText')})")
        elif method == "Network.responseReceived" and p["response"]["status"] >= 400:
            failed(p["response"]["url"], f"HTTP {p['response']['status']}")
        elif method == "Runtime.exceptionThrown":
            details = p["exceptionDetails"]
            problems.append(
                f"exception: {details.get('exception', {}).get('description') or details.get('text')}"
            )
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            problems.append(
                "console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"])
            )
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            entry = p["entry"]
            if entry.get("source") == "network":  # the failed request itself, reported above
                failed(entry.get("url", base + "?"), f"log: {entry['text']}")
            else:
                problems.append(f"log: {entry['text']} {entry.get('url', '')}")
    return problems


# The page's text outside code, with the number of typeset formulas: raw TeX delimiters left in it
# mean MathJax did not run (e.g. loaded from a CDN, offline).
_MATH_STATE = r"""(() => {
  const body = document.body.cloneNode(true);
  body.querySelectorAll("pre, code, script, style, mjx-assistive-mml").forEach((e) => e.remove());
  const raw = body.textContent.match(/\\\(|\\\[/g) || [];
  return {raw: raw.length, typeset: document.querySelectorAll("mjx-container").length};
})()"""
# Pages whose formulas must show typeset (the rest must merely show no raw TeX).
MATH_PAGES = ("api/generated/jaxopt_dist.diloco.html",)


def _raw_math(browser, page: str, wait: float = 15.0) -> list[str]:
    """Waits up to ``wait`` seconds for MathJax to typeset ``page``; the problems left."""
    deadline = time.monotonic() + wait
    while True:
        state = browser.call("Runtime.evaluate", session=True, expression=_MATH_STATE, returnByValue=True)[
            "result"
        ]["value"]
        done = state["raw"] == 0 and (state["typeset"] > 0 or page not in MATH_PAGES)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    problems = []
    if state["raw"]:
        problems.append(f"raw TeX: {state['raw']} \\( or \\[ delimiters shown as text (MathJax did not run)")
    if page in MATH_PAGES and not state["typeset"]:
        problems.append("no formula typeset (no mjx-container)")
    return problems


def test_pages_load_without_errors_in_chromium(site, tmp_path):
    base, server_errors = site
    browser = _DevTools(_chromium(), tmp_path / "profile")
    try:
        report = {}
        for page in PAGES:
            events = browser.open(base + page)
            seen = {
                e["params"]["response"]["url"]
                for e in events
                if e.get("method") == "Network.responseReceived"
            }
            assert base + page in seen, f"{page}: the page itself was not served"
            assert len(seen) > 5, f"{page}: only {sorted(seen)} loaded (no stylesheets or scripts?)"
            title = browser.call("Runtime.evaluate", session=True, expression="document.title")
            assert "jaxopt_dist" in title["result"]["value"], title
            report[page] = _problems(events, base) + _raw_math(browser, page)
    finally:
        browser.close()
    report["server"] = server_errors  # requests the server answered with an error
    assert report == {page: [] for page in (*PAGES, "server")}
