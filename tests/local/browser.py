"""A headless Chromium a test steers step by step (tools/node/browser.js: playwright-core driving Debian's chromium,
as tests/coordinator/test_card_rendering.py does): profiles with their own cookies and JavaScript on or off, tabs,
clicks by visible text, the page's text, screenshots, and a script's GET with a profile's cookies.

Without the browser the test fails, saying how to install it; it never skips."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Self

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tools" / "node" / "browser.js"
CHROMIUM = Path("/usr/bin/chromium")
STEP_TIMEOUT = 60.0


@dataclass(frozen=True)
class Navigation:
    """A page as the person sees it after a step: where it is, the HTTP status of its document, its text, how many
    form POSTs the step sent and the status of each one's answer."""

    url: str
    status: int
    text: str
    posts: int
    answers: list[int | None] = field(default_factory=list)

    def words(self) -> str:
        """The text with its layout whitespace (table cells, line breaks) as single spaces."""
        return " ".join(self.text.split())


class Browser:
    def __init__(self, screenshots: Path) -> None:
        assert CHROMIUM.is_file(), (
            f"{CHROMIUM} is missing: the browser tests need Debian's chromium; run bash scripts/bootstrap.sh "
            "(as root with apt access it installs it)"
        )
        node = shutil.which("node")
        assert node, "node is not on PATH (Node 20+ is a prerequisite, see README)"
        self.screenshots = screenshots
        screenshots.mkdir(parents=True, exist_ok=True)
        # Chromium's profile folders go to a home of its own, not among the screenshots.
        self._home = tempfile.TemporaryDirectory(prefix="browser-home-")
        # A file, not a pipe: a pipe nobody reads could fill up and stall the driver.
        self._stderr = Path(self._home.name) / "stderr.txt"
        with self._stderr.open("w") as stderr:
            self._process = subprocess.Popen(
                [node, str(DRIVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={"PATH": "/usr/bin:/bin", "CHROMIUM": str(CHROMIUM), "HOME": self._home.name},
            )
        self._next = 0
        self._lock = threading.Lock()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        stdin: IO[str] | None = self._process.stdin
        if stdin is not None:
            stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=10)
        self._home.cleanup()

    def call(self, op: str, **arguments: Any) -> Any:
        with self._lock:
            self._next += 1
            assert self._process.stdin is not None
            assert self._process.stdout is not None
            self._process.stdin.write(json.dumps({"id": self._next, "op": op, **arguments}) + "\n")
            self._process.stdin.flush()
            line = _read_line(self._process.stdout, STEP_TIMEOUT)
            if not line:
                # Ended, or stuck in this step: either way no later step could be trusted.
                self._process.kill()
                code = self._process.wait(timeout=10)
                raise AssertionError(
                    f"tools/node/browser.js gave no answer to {op} (it ended, or said nothing for {STEP_TIMEOUT:g} s; "
                    f"exit {code}): " + self._stderr.read_text(errors="replace")
                )
            answer = json.loads(line)
        if not answer["ok"]:
            raise AssertionError(f"browser {op} {arguments}: {answer['error']}")
        return answer["value"]

    def click_together(self, tabs: list[Tab], text: str) -> list[Navigation]:
        """The same click in every tab at once (their requests race at the server)."""
        values = self.call("clickTogether", pages=[tab.page for tab in tabs], text=text)
        return [Navigation(**value) for value in values]

    def profile(self, *, javascript: bool) -> Profile:
        return Profile(self, self.call("context", javaScript=javascript)["context"])


def _read_line(stream: IO[str], timeout: float) -> str:
    """One line from the driver, or "" when it has not answered within ``timeout`` (a step hanging fails the test
    rather than the whole run)."""
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return result[0] if result else ""


class Profile:
    """A browser profile: its own cookies (so its own sign-in) and JavaScript on or off."""

    def __init__(self, browser: Browser, context: str) -> None:
        self.browser = browser
        self.context = context

    def tab(self) -> Tab:
        return Tab(self.browser, self.browser.call("page", context=self.context)["page"])

    def fetch(self, url: str, *, accept: str) -> dict[str, Any]:
        """A script's GET with this profile's cookies: ``status``, ``contentType``, ``body``."""
        answer: dict[str, Any] = self.browser.call("fetch", context=self.context, url=url, accept=accept)
        return answer


class Tab:
    def __init__(self, browser: Browser, page: str) -> None:
        self.browser = browser
        self.page = page

    def _step(self, op: str, **arguments: Any) -> Navigation:
        return Navigation(**self.browser.call(op, page=self.page, **arguments))

    def goto(self, url: str) -> Navigation:
        return self._step("goto", url=url)

    def click(self, text: str) -> Navigation:
        return self._step("click", text=text)

    def double_click(self, text: str) -> Navigation:
        return self._step("dblclick", text=text)

    def read(self) -> Navigation:
        return self._step("read")

    def text_of(self, selector: str) -> str:
        """The text of the element ``selector`` (CSS) names, its layout whitespace as single spaces."""
        return " ".join(str(self.browser.call("textOf", page=self.page, selector=selector)).split())

    def arrive(self, url: str) -> Navigation:
        """The page once it is at ``url``, where something on the page took it."""
        return self._step("arrive", url=url)

    def screenshot(self, name: str) -> Path:
        path = self.browser.screenshots / f"{name}.png"
        self.browser.call("screenshot", page=self.page, path=str(path))
        return path
