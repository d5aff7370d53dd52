"""Take the screenshots of README.md and docs/ from the running demo, in headless chromium,
so that they show the pages as they are now.

    .venv/bin/python scripts/screenshots.py            # writes docs/img/dashboard.png, admin-cluster.png
    .venv/bin/python scripts/screenshots.py --out /tmp # elsewhere

It starts the demo site (daphne, SQLite, the in-memory layer) on a free port, logs in as
the demo user, switches the slow network on until ``atelier:load`` backs off to 2000 ms,
fires the burst of shots, and takes the dashboard; then logs in as staff and takes the
admin's Realtime cluster screen. The browser's flags are the test suite's
(``tests/support/browser.py``): Debian's chromium, headless, no sandbox, no GPU, no network
beyond 127.0.0.1.
"""

from __future__ import annotations

import argparse
import base64
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from selenium.webdriver.common.by import By  # noqa: E402

from tests.support.browser import chromium, log_in, wait  # noqa: E402
from tests.support.servers import Server, prepare_database  # noqa: E402


def text(browser, css: str) -> str:
    return browser.find_element(By.CSS_SELECTOR, css).text


def dashboard(browser, base: str, out: Path) -> Path:
    log_in(browser, base, "demo", "demo")
    browser.get(base + "/")
    print("dashboard: waiting for the live values…", flush=True)
    wait(browser, 20).until(lambda b: text(b, "#row-load .seq") not in ("", "–"))
    browser.find_element(By.ID, "slow-network").click()
    print("dashboard: slow network on, waiting for atelier:load to back off to 2000 ms…", flush=True)
    wait(browser, 30).until(lambda b: text(b, "#load-cadence") == "2000 ms")
    browser.find_element(By.ID, "burst").click()
    wait(browser, 20).until(lambda b: int(text(b, "#burst-admitted") or 0) + int(text(b, "#burst-refused") or 0) == 60)
    wait(browser, 20).until(lambda b: "saved ✓" in text(b, "#durable"))
    path = out / "dashboard.png"
    full_page(browser, path)
    return path


def admin(browser, base: str, out: Path) -> Path:
    browser.delete_all_cookies()
    log_in(browser, base, "admin", "admin")
    browser.get(base + "/admin/realtime_app/realtimecluster/")
    print("admin: waiting for the charts to take a few probes (about 20 s)…", flush=True)
    wait(browser, 20).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#rc-cards [data-instance]"))
    wait(browser, 60).until(
        lambda b: int(b.find_element(By.CSS_SELECTOR, "[data-chart=frames_out]").get_attribute("data-points") or 0) >= 8
    )
    path = out / "admin-cluster.png"
    full_page(browser, path)
    return path


def full_page(browser, path: Path) -> None:
    """The whole page at 1280 px wide, not only the window (Chrome DevTools protocol)."""
    metrics = browser.execute_cdp_cmd("Page.getLayoutMetrics", {})
    size = metrics["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": 1280, "height": size["height"], "scale": 1}
    shot = browser.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    path.write_bytes(base64.b64decode(shot["data"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="directory (default docs/img)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print("starting the demo site…", flush=True)
    database = prepare_database(str(Path(tempfile.mkdtemp(prefix="screenshots-")) / "db.sqlite3"))
    server = Server({**database, "REDIS_URL": ""}).start()  # the demo site, as the tests run it
    browser = chromium()
    try:
        browser.set_window_size(1280, 800)
        for take in (dashboard, admin):
            print(f"wrote {take(browser, server.http, args.out)}", flush=True)
    finally:
        browser.quit()
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
