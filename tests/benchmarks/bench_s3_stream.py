"""The trainer's stream from S3 (moto's server on loopback, ``tests/s3server.py``) with an added
time to first byte per request, as a real object store has: samples/s with one read in flight
(``READ_AHEAD = 1``) against the default read-ahead, and against the same shards in a local
folder, in one run, printed as ratios. Every read is
one ranged GET of one sample either way; only the overlap changes.

    .venv/bin/python tests/benchmarks/bench_s3_stream.py [--samples 200] [--latency-ms 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def export(root: Path, n: int) -> Path:
    from tests.trainer.test_trainer import dag
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.demo import demo_overrides, make_demo
    from vlcurate.pipeline.runner import run
    data = make_demo(root / "data", n=n, seed=5)
    cfg = C.load(None, {**demo_overrides(data, root / "run"), "run.progress": False,
                        "export.samples_per_shard": 50})
    run(cfg, dag=dag(), executor="local", log=lambda _: None)
    return root / "run" / "export" / "shards"


def slow_server(latency_s: float) -> None:
    """Every request waits ``latency_s`` before moto serves it (the request log's append)."""
    import tests.s3server as S

    class SlowLog(list):
        def append(self, x) -> None:
            time.sleep(latency_s)
            super().append(x)
    original = S._counting_server
    S._counting_server = lambda port, log: original(port, SlowLog())


def timed(shards, depth: int, epoch: int) -> tuple[int, float]:
    from vlcurate.trainer import data as D
    D.READ_AHEAD, D._POOL = depth, None
    D.read_ahead.__defaults__ = (depth,)
    t = time.perf_counter()
    n = sum(1 for _ in shards.stream(epoch=epoch, seed=0, rank=0, world=1))
    return n, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    a = ap.parse_args()
    from tests.s3server import s3_server
    from vlcurate.foundation import storage
    from vlcurate.trainer import data as D
    default = D.READ_AHEAD
    local = export(Path(tempfile.mkdtemp()), a.samples)
    slow_server(a.latency_ms / 1000)
    with s3_server() as s3:
        storage.forget_clients()
        uri = f"{s3.bucket()}/shards"
        storage.upload_dir(str(local), uri)
        shards = D.ShardSet(uri)
        rates = {}
        for epoch, depth in enumerate((1, default, 1, default)):
            n, s = timed(shards, depth, epoch)
            rates.setdefault(depth, []).append(n / s)
            print(f"read_ahead={depth:3d}: {n} samples in {s:.2f} s ({n / s:.0f} samples/s)")
    n, s = timed(D.ShardSet(str(local)), default, 0)
    print(f"local folder, read_ahead={default}: {n} samples in {s:.2f} s ({n / s:.0f} samples/s)")
    best = {d: max(r) for d, r in rates.items()}
    print(f"ratio read_ahead={default} / read_ahead=1 on S3: {best[default] / best[1]:.1f}x; "
          f"S3 / local: {best[default] / (n / s):.2f} "
          f"(latency {a.latency_ms:.0f} ms a request; load {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
