"""Retake the playground's screenshots in docs/ (1280x800, the shipped model, headless Chromium):

    python docs/playground_screenshots.py

``docs/playground.png``: a sampled text, each token shaded by its probability, one token's tip open;
``docs/playground-attention.png``: one token's attention view (the strips, one head enlarged, the matrix).
Needs what the tests need: ``.[test]`` and Debian's Chromium (``apt-get install chromium``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

DOCS = Path(__file__).resolve().parent
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
PROMPT = "HAMLET:\nTo be, or not to be, that is the question:\n"


def generate(page: Page, max_tokens: int) -> None:
    page.get_by_test_id("prompt").fill(PROMPT)
    page.get_by_test_id("temperature").fill("0.8")
    page.get_by_test_id("seed").fill("5")
    page.get_by_test_id("max-tokens").fill(str(max_tokens))
    page.get_by_test_id("generate").click()
    status = "document.querySelector('[data-testid=status]').textContent"
    page.wait_for_function(f"() => {status}.startsWith('Done')")


def main() -> None:
    # (one slot: a lone user's steps compute one row, not eight)
    command = [sys.executable, "-m", "generate.tools.gptgen", "playground", "--port", "0", "--max-slots", "1"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = re.search(r"listening on (http://\S+)", server.stderr.readline()).group(1)
    try:
        while httpx.get(url + "/health").status_code != 200:
            time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.goto(url + "/")
            generate(page, 48)
            generated = page.locator("[data-kind=generated]").all()[:24]
            unlikely = min(generated, key=lambda t: float(t.get_attribute("data-logprob")))
            unlikely.hover()
            page.screenshot(path=DOCS / "playground.png")
            generate(page, 12)
            tokens = page.locator("[data-testid=token]")
            tokens.nth(tokens.count() - 4).click()
            page.wait_for_selector("[data-testid=attention-cell]")
            page.select_option("#layer", "6")
            cell = "document.querySelector('[data-testid=attention-cell]')"
            page.wait_for_function(f"() => {cell}.dataset.layer == 6")
            page.mouse.move(0, 0)
            page.evaluate("window.scrollTo(0, document.getElementById('attention').offsetTop - 10)")
            time.sleep(0.5)  # (the smooth scroll)
            page.screenshot(path=DOCS / "playground-attention.png")
            browser.close()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


if __name__ == "__main__":
    main()
