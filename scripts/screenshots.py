"""Screenshots of the playground for the README (``python scripts/screenshots.py``): the
linear model forked into two branches (desktop), a chat at phone width, and the softmax
baseline whose state grows turn by turn. Starts its own servers on 127.0.0.1; needs Debian's
chromium and Playwright. Writes ``docs/playground-*.png``."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serverproc import ServerProcess  # noqa: E402

DOCS = ROOT / "docs"


def ready(page: Any) -> None:
    while "Model" not in page.inner_text("#model"):
        time.sleep(0.05)


def generate(page: Any, prompt: str | None = None) -> None:
    if prompt is not None:
        page.fill("#prompt", prompt)
    page.click("#generate")
    page.wait_for_selector("#generate:not([disabled])", timeout=60_000)


def desktop(browser: Any, url: str) -> None:
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(url)
    ready(page)
    page.fill("#max_tokens", "60")
    page.fill("#seed", "3")
    generate(page)
    page.click("#fork-session")
    page.wait_for_selector(".pane >> nth=1")
    generate(page, "\n")
    generate(page, "\n")
    page.screenshot(path=str(DOCS / "playground-desktop.png"), full_page=True)
    page.close()


def phone(browser: Any, url: str) -> None:
    page = browser.new_page(viewport={"width": 390, "height": 844}, device_scale_factor=2)
    page.goto(url)
    ready(page)
    page.check("input[value=chat]")
    page.fill("#max_tokens", "40")
    generate(page, "Good morrow! What news from Verona?")
    page.screenshot(path=str(DOCS / "playground-phone.png"))
    page.close()


def softmax(browser: Any, url: str) -> None:
    page = browser.new_page(viewport={"width": 1360, "height": 900})
    page.goto(url)
    ready(page)
    page.fill("#max_tokens", "120")
    for _ in range(4):
        generate(page, "\n")
    page.screenshot(path=str(DOCS / "playground-softmax.png"), full_page=True)
    page.close()


def main() -> None:
    from playwright.sync_api import sync_playwright

    DOCS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium"),
                                     args=["--no-sandbox"])
        with ServerProcess(ROOT / "weights" / "linear") as srv:
            desktop(browser, srv.url)
            phone(browser, srv.url)
        with ServerProcess(ROOT / "weights" / "softmax") as srv:
            softmax(browser, srv.url)
        browser.close()
    print("wrote", *sorted(str(p.relative_to(ROOT)) for p in DOCS.glob("playground-*.png")))


if __name__ == "__main__":
    main()
