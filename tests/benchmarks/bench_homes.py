"""Per-image work on a shuffled multi-caption source: COCO's five captions per image, rows
shuffled (as an img2dataset download has them: an image's rows in several parts), through the
README's small config (real EfficientNet-Lite0 and MiniLM, PP-OCR when installed), in-process.
Prints per per-image stage its wall time, the images it computed against the distinct images
(``stages.images.COMPUTED``, and the run's own count where the code has one), the text-spotting
cache's entries, and the load average.

    .venv/bin/python tests/benchmarks/bench_homes.py [--out /tmp/vlc-homes] [--rows-per-part 100]

Run it from another checkout's root (``PYTHONPATH=<checkout's parent with vlcurate>``) for the
same figures of that code.
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.paths import SHARED_DATA  # noqa: E402

DATA = SHARED_DATA / "coco_mini"
STAGES = ["ids", "textspot", "embed", "recaption", "teacher"]


def shuffled_source(out: Path, seed: int) -> Path:
    """``out/captions.csv``: coco_mini's caption rows shuffled; ``out/images``: a link."""
    out.mkdir(parents=True, exist_ok=True)
    with open(DATA / "captions.csv", newline="") as fh:
        reader = csv.reader(fh)
        header, rows = next(reader), list(reader)
    random.Random(seed).shuffle(rows)
    with open(out / "captions.csv", "w", newline="") as fh:
        csv.writer(fh).writerows([header, *rows])
    if not (out / "images").exists():
        (out / "images").symlink_to((DATA / "images").resolve())
    return out


def cache_entries(run_dir: Path) -> int:
    import pyarrow.parquet as pq
    return sum(pq.read_metadata(p).num_rows for p in (run_dir / "_cache").rglob("seg-*.parquet"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/vlc-homes")
    ap.add_argument("--rows-per-part", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not DATA.exists():
        print(f"no {DATA}: nothing to measure")
        return 0
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.runner import run
    from vlcurate.stages import base
    out = Path(args.out)
    shutil.rmtree(out / "run", ignore_errors=True)
    source = shuffled_source(out / "data", args.seed)
    cfg = C.load(str(ROOT / "pipeline/configs/small.yaml"), {
        "source.path": str(source), "source.key_column": "caption_id",
        "source.extra_columns": ["coco_split"], "source.rows_per_part": args.rows_per_part,
        "source.allow_outside_source": True,     # images/ links to ../shared/data
        "run.run_dir": str(out / "run"), "run.stages": STAGES, "run.progress": False})
    t0 = time.time()
    results = run(cfg, executor="local", log=lambda _: None)
    wall = time.time() - t0
    print(f"coco_mini shuffled (seed {args.seed}), {args.rows_per_part}-row parts, "
          f"{results[0].manifest['parts']} parts, {results[0].manifest['rows']} rows; "
          f"run {wall:.1f} s; load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'stage':10} {'wall s':>7} {'computed':>9} {'distinct':>9}")
    for r in results:
        if r.manifest["stage"] in STAGES[1:]:
            said = (r.info or {}).get("images") or {}
            print(f"{r.manifest['stage']:10} {r.manifest['wall_s']:7.1f} "
                  f"{said.get('computed', '-'):>9} {said.get('distinct', '-'):>9}")
    print("images computed where each stage computes:", dict(base.COMPUTED))
    print("text-spotting cache entries:", cache_entries(out / "run"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
