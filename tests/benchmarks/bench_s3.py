"""Ingest -> ids -> export over the real Flickr8k pairs (one caption per photo) with the source
and the run directory in a bucket (a real S3 HTTP API: moto's server on loopback) against the
same run on local folders, in one process, interleaved.

    .venv/bin/python tests/benchmarks/bench_s3.py [--repeat 2] [--rows-per-part 250]

Prints one table and the S3 / local wall-time ratio, with the load average. moto answers from
memory on loopback, so the ratio measures request overhead (LIST, GET by range, PUT, the commit
records), not a network: on a real bucket add the round trips.
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
from tests.s3server import s3_server  # noqa: E402

DATA = SHARED_DATA / "flickr8k_224"


def once(base: dict, source: str, run_dir: str) -> tuple[float, dict]:
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.runner import run
    cfg = C.load(None, {**base, "source.path": source, "run.run_dir": run_dir})
    t0 = time.perf_counter()
    res = run(cfg, executor="local", log=lambda _: None)
    return time.perf_counter() - t0, {r.manifest["stage"]: r.manifest for r in res}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows-per-part", type=int, default=250)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} not found")
        return 0
    from vlcurate.foundation import storage
    tmp = Path(tempfile.mkdtemp(prefix="vlc-bench-s3-"))
    base = {"source.max_captions_per_image": 1, "source.rows_per_part": a.rows_per_part,
            "run.progress": False, "export.samples_per_shard": 1000, "run.stages": ["ids"]}
    with s3_server() as s3:
        storage.forget_clients()
        bucket = s3.bucket()
        t0 = time.perf_counter()
        storage.upload_dir(str(DATA), f"{bucket}/flickr8k_224")
        upload = time.perf_counter() - t0
        rows = []
        for i in range(a.repeat):      # interleaved, so that machine noise hits both alike
            rows.append(("local",) + once(base, str(DATA), str(tmp / f"local{i}")))
            before = len(s3.log)
            rows.append(("s3",) + once(base, f"{bucket}/flickr8k_224", f"{bucket}/run{i}"))
            requests = len(s3.log) - before
    pairs = rows[0][2]["ingest"]["rows"]
    print(f"\nFlickr8k 224px, {pairs} pairs, {rows[0][2]['ingest']['parts']} parts; load average "
          f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; upload to the bucket "
          f"{upload:.1f}s (not counted)\n")
    print(f"{'where':<7}{'wall s':>8}{'pairs/s':>9}{'ingest s':>10}{'ids s':>7}{'export s':>10}")
    for where, wall, m in rows:
        print(f"{where:<7}{wall:8.2f}{pairs / wall:9.0f}{m['ingest']['wall_s']:10.2f}"
              f"{m['ids']['wall_s']:7.2f}{m['export']['wall_s']:10.2f}")
    best = {w: min(x for e, x, _ in rows if e == w) for w in ("local", "s3")}
    print(f"\nS3 / local wall time (best of {a.repeat}): {best['s3'] / best['local']:.2f}x; "
          f"{requests} S3 requests in the last S3 run ({requests / pairs:.2f} a pair)")
    same = rows[0][2]["export"]["rows_kept"] == rows[1][2]["export"]["rows_kept"]
    print(f"kept {rows[0][2]['export']['rows_kept']} of {pairs} pairs; same on S3: {same}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
