"""Screenshots of `lcap ui`'s pages over a store, for the README (docs/ui-*.png).

    .venv/bin/python scripts/ui_screenshots.py lcap-demo/lcap.duckdb [--out docs]

Starts `lcap ui` on the store, opens each page in Debian's headless Chromium (Playwright) and saves a
PNG per page: the overview, the episode list, the episode page of the latest round's best rewarded
training episode, and its group (best vs worst).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

from lcap.store import Store

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def pick_episode(db: Path) -> tuple[str, int, str, str]:
    """(episode, round, split, task) of the latest round's best rewarded training episode with the most calls."""
    rows = Store(db).fetchall(
        """SELECT e.episode_id, e.round, coalesce(e.split, 'train'), e.task_id
           FROM episodes e JOIN latest_rewards r USING (episode_id)
           WHERE e.round IS NOT NULL AND coalesce(e.split, 'train') = 'train' AND e.task_id IS NOT NULL
           ORDER BY e.round DESC, r.reward DESC,
                    (SELECT count(*) FROM turns t WHERE t.episode_id = e.episode_id) DESC, e.episode_id
           LIMIT 1"""
    )
    if not rows:
        raise SystemExit(f"{db}: no rewarded training episode to show")
    return rows[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("db", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs")
    ap.add_argument("--port", type=int, default=8766)
    args = ap.parse_args()
    episode, round_, split, task = pick_episode(args.db)
    pages = {
        "ui-overview.png": "/",
        "ui-episodes.png": "/episodes",
        "ui-episode.png": "/episode?" + urlencode({"id": episode}),
        "ui-group.png": "/group?" + urlencode({"round": round_, "split": split, "task": task}),
    }
    lcap = str(Path(sys.executable).with_name("lcap"))
    server = subprocess.Popen([lcap, "ui", "--db", str(args.db), "--port", str(args.port)], stdout=subprocess.PIPE)
    try:
        from playwright.sync_api import sync_playwright

        time.sleep(2)
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            for name, path in pages.items():
                page.goto(f"http://127.0.0.1:{args.port}{path}")
                page.wait_for_selector("#live.on", timeout=15_000)
                page.screenshot(path=str(args.out / name), full_page=True)
                print(f"{args.out / name}: {path}")
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
