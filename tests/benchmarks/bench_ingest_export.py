"""Pairs/s through ingest -> ids -> export on the 2,762 real Flickr8k pairs (one caption per
photo), through the Ray pipeline versus the same stage objects called in-process.

    .venv/bin/python tests/benchmarks/bench_ingest_export.py [--rows-per-part 250] [--repeat 2]

Prints one table; the figure to watch is ray/local wall time (goal <= 1.3x). Ray's own start-up
(ray.init) is measured separately and not counted: a cluster is up before a job starts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA  # noqa: E402
DATA = SHARED_DATA / "flickr8k_224"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows-per-part", type=int, default=250)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=os.cpu_count())
    a = ap.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} not found")
        return 0
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.runner import run

    tmp = Path(tempfile.mkdtemp(prefix="vlc-bench-"))
    base = {"source.path": str(DATA), "source.max_captions_per_image": 1,
            "source.rows_per_part": a.rows_per_part, "run.progress": False,
            "export.samples_per_shard": 1000, "ray.num_cpus": a.cpus,
            "run.stages": ["ids"]}   # ingest -> ids -> export: the spine

    def once(executor: str, i: int) -> tuple[float, dict]:
        cfg = C.load(None, {**base, "run.run_dir": str(tmp / f"{executor}{i}")})
        t0 = time.perf_counter()
        res = run(cfg, executor=executor, log=lambda _: None)
        wall = time.perf_counter() - t0
        return wall, {r.manifest["stage"]: r.manifest for r in res}

    rows = []
    t0 = time.perf_counter()
    import ray
    ray.init(num_cpus=a.cpus, include_dashboard=False, logging_level="ERROR")
    ray_init = time.perf_counter() - t0
    once("ray", -1)  # warm-up: worker processes, imports
    for i in range(a.repeat):  # interleave so that machine noise hits both alike
        for ex in ("local", "ray"):
            wall, m = once(ex, i)
            rows.append((ex, wall, m))
    pairs = rows[0][2]["ingest"]["rows"]
    best = {ex: min(w for e, w, _ in rows if e == ex) for ex in ("local", "ray")}
    print(f"\nFlickr8k 224px, {pairs} pairs, {rows[0][2]['ingest']['parts']} parts of "
          f"{a.rows_per_part}, {a.cpus} CPUs (ray.init {ray_init:.1f}s, not counted)\n")
    print(f"{'executor':<9}{'wall s':>8}{'pairs/s':>9}{'ingest s':>10}{'ids s':>7}{'export s':>10}")
    for ex, wall, m in rows:
        print(f"{ex:<9}{wall:8.2f}{pairs / wall:9.0f}{m['ingest']['wall_s']:10.2f}"
              f"{m['ids']['wall_s']:7.2f}{m['export']['wall_s']:10.2f}")
    print(f"\nray / local wall time (best of {a.repeat}): {best['ray'] / best['local']:.2f}x "
          f"(goal <= 1.3x)")
    kept = rows[0][2]["export"]["rows_kept"]
    print(f"kept {kept} of {pairs} pairs")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
