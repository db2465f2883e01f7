"""Check the built book in a real browser: `make book-check` (issue 44).

Opens every page of the built HTML book in headless Chromium at 1280 px wide, as a
reader's laptop shows it, and fails on what a reader would trip over:

- a line of code (a code cell's input, or a code block in the prose) that scrolls
  sideways: wider than the book's column;
- an image that fails to load;
- math that MathJax did not render (`\\(` ... `\\)` left as text);
- an internal link whose page, or whose #anchor on that page, does not exist.

It saves a screenshot of every page in OUT (default _build/book-check/). Outputs of
cells that scroll sideways (a wide printed table) are counted but do not fail.

    python tools/book_check.py [HTML_DIR] [--out DIR] [--pages GLOB ...] [--require]

Needs Chromium (Debian: `apt-get install chromium`) and the `playwright` package
(`pip install playwright`; it drives the installed Chromium, nothing is downloaded).
Without them it says so plainly and exits 0, or 1 with --require (for a CI job that
has them).
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1280, 900
SKIP = ("_static/", "_sources/", "_images/", "genindex.html", "search.html")
CHROMIUM = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Run in the page once it has loaded (and MathJax, when the page has it, has typeset).
PROBE = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const wide = (sel) => [...document.querySelectorAll(sel)]
    .filter((pre) => pre.scrollWidth > pre.clientWidth + 1)
    .map((pre) => {
      const lines = pre.innerText.split("\\n");
      const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), "");
      return {over: pre.scrollWidth - pre.clientWidth, line: longest.slice(0, 120)};
    });
  const code = wide(".cell_input pre, div.highlight:not(.cell_output *) pre");
  const outputs = wide(".cell_output pre");
  const images = [...document.images]
    .filter((img) => !img.complete || img.naturalWidth === 0)
    .map((img) => img.getAttribute("src"));
  const math = [...document.querySelectorAll(".math")]
    .filter((el) => !el.querySelector("mjx-container"))
    .map((el) => el.textContent.trim().slice(0, 80));
  return {code, outputs, images, math};
}"""


class Links(HTMLParser):
    """The ids and the internal hrefs of one page."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        href = attrs.get("href") if tag == "a" else None
        if href and not urlsplit(href).scheme and not href.startswith("//"):
            self.hrefs.append(href)


def parse(page: Path) -> Links:
    links = Links()
    links.feed(page.read_text(errors="replace"))
    return links


def broken_links(page: Path, html_dir: Path, cache: dict) -> list[str]:
    """Internal links of page whose file, or #anchor in it, does not exist."""
    found = []
    for href in parse(page).hrefs:
        parts = urlsplit(href)
        if parts.path:
            target = (page.parent / unquote(parts.path)).resolve()
        else:
            target = page.resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            found.append(f"{href} (no such file)")
            continue
        if parts.fragment and target.suffix == ".html":
            if target not in cache:
                cache[target] = parse(target).ids
            if unquote(parts.fragment) not in cache[target]:
                found.append(f"{href} (no #{parts.fragment} there)")
    return found


def pages(html_dir: Path, globs: list[str]) -> list[Path]:
    found = []
    for page in sorted(html_dir.rglob("*.html")):
        rel = page.relative_to(html_dir).as_posix()
        if any(rel.startswith(s) or rel == s for s in SKIP):
            continue
        if 'http-equiv="Refresh"' in page.read_text(errors="replace")[:2000]:
            continue  # a redirect (the root index.html): its target is checked
        if globs and not any(fnmatch.fnmatch(rel, g) for g in globs):
            continue
        found.append(page)
    return found


def browser_path() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM) if p), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", nargs="?", default=str(ROOT / "_build" / "html"))
    ap.add_argument("--out", default=str(ROOT / "_build" / "book-check"))
    ap.add_argument("--pages", nargs="*", default=[], help="globs, e.g. chapters/14*")
    ap.add_argument("--require", action="store_true", help="fail without Chromium")
    args = ap.parse_args(argv)
    html_dir, out = Path(args.html).resolve(), Path(args.out)
    if not (html_dir / "index.html").exists():
        print(f"book-check: no built book in {html_dir}: run `make book` first")
        return 1
    chromium = browser_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        missing = [
            *(["Chromium (apt-get install chromium)"] if chromium is None else []),
            *(["playwright (pip install playwright)"] if not sync_playwright else []),
        ]
        print(f"book-check: NOT RUN: {' and '.join(missing)} not installed here")
        return 1 if args.require else 0
    out.mkdir(parents=True, exist_ok=True)
    todo, problems, wide_outputs, ids = pages(html_dir, args.pages), 0, 0, {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        tab = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        for page in todo:
            rel = page.relative_to(html_dir).as_posix()
            tab.goto(page.as_uri(), wait_until="load")
            seen = tab.evaluate(PROBE)
            shot = out / (re.sub(r"[^\w.-]+", "_", rel[:-5]) + ".jpg")
            tab.screenshot(path=str(shot), full_page=True, type="jpeg", quality=60)
            found = [f"code scrolls {c['over']} px sideways: {c['line']!r}"
                     for c in seen["code"]]  # fmt: skip
            found += [f"image does not load: {src}" for src in seen["images"]]
            found += [f"math not rendered: {m!r}" for m in seen["math"]]
            found += [f"broken link: {x}" for x in broken_links(page, html_dir, ids)]
            wide_outputs += len(seen["outputs"])
            for line in found:
                print(f"{rel}: {line}", flush=True)
            problems += len(found)
        browser.close()
    print(
        f"book-check: {len(todo)} pages at {WIDTH} px, {problems} problem(s); "
        f"{wide_outputs} cell output(s) scroll sideways (not counted); "
        f"screenshots in {out}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
