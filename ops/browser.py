"""Headless Chromium for the stack's web UIs: render a page, return its visible text, save a screenshot.

Both UIs (Prefect's and MLflow's) are single-page apps: what a user sees exists only after their JavaScript ran,
so a page is checked through the DOM Chromium dumps after a virtual-time budget, not through the HTML the
server sends. Needs Debian's ``chromium`` (``apt-get install chromium``); :func:`executable` finds it.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

# Flags that render both UIs headless on these machines (STACK-NOTES): no sandbox (root in containers), no GPU,
# nothing fetched from the internet.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]
# Virtual time for the apps to fetch their data and draw; a page is dumped or shot when it has passed.
BUDGET_MS = 30_000


class BrowserError(RuntimeError):
    """Chromium is missing or failed to render a page."""


def executable() -> str | None:
    """Chromium's path, or None when it is not installed."""
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@dataclass(frozen=True)
class Dom:
    """What a rendered page shows: its visible text and the sources of its images."""

    text: str
    images: list[str]


class _Reader(HTMLParser):
    """The text a reader sees (character data outside <script>, <style> and <noscript>) and the <img> sources."""

    HIDDEN = {"script", "style", "noscript"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.images: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in self.HIDDEN:
            self._hidden += 1
        elif tag == "img" and (src := dict(attrs).get("src")):
            self.images.append(src)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.HIDDEN and self._hidden:
            self._hidden -= 1

    def handle_data(self, data: str) -> None:
        if not self._hidden and data.strip():
            self.parts.append(data.strip())


def read_dom(html: str) -> Dom:
    """The visible text (one space between pieces) and image sources of an HTML document."""
    parser = _Reader()
    parser.feed(html)
    return Dom(" ".join(parser.parts), parser.images)


def _chromium(args: list[str], url: str, window: tuple[int, int], budget_ms: int) -> str:
    exe = executable()
    if exe is None:
        raise BrowserError("chromium not found: install it (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="aiayn-chromium-") as profile:
        res = subprocess.run([exe, *FLAGS, f"--window-size={window[0]},{window[1]}",
                              f"--virtual-time-budget={budget_ms}", f"--user-data-dir={profile}", *args, url],
                             capture_output=True, text=True, timeout=budget_ms / 1000 + 120,
                             stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise BrowserError(f"chromium failed on {url} (exit {res.returncode}): {res.stderr[-2000:]}")
    return res.stdout


def render(url: str, screenshot: Path | None = None, *, window: tuple[int, int] = (1600, 1100),
           budget_ms: int = BUDGET_MS) -> Dom:
    """Open ``url`` headless; return what the rendered page shows and, given ``screenshot``, save a PNG of it
    there (written to a temporary name, then renamed). Raises :class:`BrowserError`."""
    dom = read_dom(_chromium(["--dump-dom"], url, window, budget_ms))
    if screenshot is not None:
        screenshot = Path(screenshot)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        tmp = screenshot.with_name(f".{screenshot.name}.tmp.png")
        _chromium([f"--screenshot={tmp}"], url, window, budget_ms)
        if not tmp.is_file():
            raise BrowserError(f"chromium wrote no screenshot of {url}")
        tmp.replace(screenshot)
    return dom
