"""The run directory on a local S3 endpoint (moto's server on loopback) against a local folder:
the same small DAG (ingest of a Parquet source -> a filter -> a stage after it, in-process
executor), alternately on each, printed as a ratio, with the HTTP requests (LISTs, GETs, PUTs)
the S3 run made, and the load average.

    .venv/bin/python tests/benchmarks/bench_s3_rundir.py [--rows 400] [--rows-per-part 20] [--repeat 2]

moto answers from memory in this process, so the ratio measures the request path (HTTP, signing,
pyarrow's S3 client, moto's parsing), not a network; the request counts are what a real bucket
would be sent.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--rows-per-part", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    from tests.pipeline import test_s3_run as T
    from tests.s3server import s3_server
    from vlcurate.foundation import storage
    from vlcurate.pipeline.runner import run

    tmp = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    source = _source(tmp, a.rows, a.rows_per_part)
    over: dict = {}
    times: dict[str, list[float]] = {"local": [], "s3": []}
    with s3_server() as s3:
        storage.forget_clients()
        for i in range(a.repeat):
            for where in ("local", "s3"):
                run_dir = str(tmp / f"run{i}") if where == "local" else f"{s3.bucket()}/run"
                at = len(s3.log)
                t0 = time.perf_counter()
                run(T.config(source, run_dir, **over), dag=T.dag(), executor="local",
                    log=lambda _: None)
                times[where].append(time.perf_counter() - t0)
                if where == "s3":
                    reqs = Counter(_kind(r) for r in s3.log[at:])
    best = {k: min(v) for k, v in times.items()}
    print(f"rows {a.rows}, parts {-(-a.rows // a.rows_per_part)}, 3 stages, best of {a.repeat}; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"local folder {best['local']:.2f}s · S3 (moto, loopback) {best['s3']:.2f}s · "
          f"ratio S3/local {best['s3'] / best['local']:.2f}")
    print("S3 requests of one run:", dict(sorted(reqs.items())))


def _kind(r: tuple[str, ...]) -> str:
    method, path = r[0], r[1]
    if method == "GET" and path.strip("/").count("/") == 0:
        return "LIST"
    return method


def _source(tmp: Path, rows: int, per_part: int) -> Path:
    """The Parquet source of tests/pipeline/test_s3_run.py, with ``rows`` rendered pairs and
    ``per_part`` rows a row group (a part)."""
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlcurate.pipeline.demo import make_demo
    demo = make_demo(tmp / "demo", n=rows, seed=5)
    with open(demo / "captions.csv", encoding="utf-8", errors="replace") as fh:
        recs = list(csv.DictReader(fh))
    img = [demo / "images" / r["image"] for r in recs]
    t = pa.table({"id": [r["id"] for r in recs], "caption": [r["caption"] for r in recs],
                  "image": [p.read_bytes() if p.is_file() else b"" for p in img]})
    (tmp / "pq").mkdir()
    pq.write_table(t, tmp / "pq" / "pairs.parquet", row_group_size=per_part)
    return tmp / "pq"


if __name__ == "__main__":
    main()
