"""A screenshot of the routing page (http://HOST:PORT/) answering one prompt, for the README.

Starts nothing itself: give it a running `tokenrouter serve` (e.g. ./scripts/run.sh for the default
pair). It drives the system's chromium (Debian: apt-get install chromium) through Playwright, types
the prompt, runs it, waits for the answer, hovers one of the larger model's tokens so the score shows,
and saves a PNG.

    python benchmarks/ui_screenshot.py --url http://127.0.0.1:8000 --out docs/ui.png
"""

from __future__ import annotations

import argparse
import shutil
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", default="ui.png")
    ap.add_argument("--prompt", default="What is 17 times 23? Explain step by step.")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threshold", type=float, default=None,
                    help="the threshold to set on the page (default: the group's)")
    ap.add_argument("--compare", choices=["none", "again", "only-first", "only-last"], default="none",
                    help="also run a second answer beside the first: 'again' at --again-threshold, or one model alone")
    ap.add_argument("--again-threshold", type=float, default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=900)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each answer")
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    if not args.chromium:
        print("no chromium found (Debian: apt-get install chromium); or pass --chromium PATH", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    timeout_ms = args.timeout * 1000
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        # bypass_csp: the page allows no eval; Playwright's waits evaluate JavaScript.
        page = browser.new_page(viewport={"width": args.width, "height": args.height}, bypass_csp=True)
        page.goto(args.url)
        if args.api_key:
            page.wait_for_selector("#auth:not([hidden])")
            page.fill("#key", args.api_key)
            page.click("#key-form button")
        page.wait_for_selector("#run:not([disabled])", timeout=timeout_ms)
        page.fill("#prompt", args.prompt)
        page.fill("#max-tokens", str(args.max_tokens))
        if args.threshold is not None:
            page.fill("#threshold", str(args.threshold))
        page.click("#run")
        page.wait_for_selector(".pane[data-state=done]", timeout=timeout_ms)
        if args.compare != "none":
            if args.compare == "again":
                if args.again_threshold is not None:
                    page.fill("#threshold", str(args.again_threshold))
                page.click("#again")
            else:
                page.locator("#only button").nth(0 if args.compare == "only-first" else -1).click()
            page.wait_for_function("document.querySelectorAll('.pane[data-state=done]').length === 2",
                                   timeout=timeout_ms)
        # Hover a token another model than the entry model wrote, so the tooltip shows the score there.
        later = page.locator(".pane .tok:not(.w0):not(.empty)")
        pick = later.nth(min(3, later.count() - 1)) if later.count() else page.locator(".pane .tok").first
        pick.hover()
        page.screenshot(path=args.out, full_page=True)
        browser.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
