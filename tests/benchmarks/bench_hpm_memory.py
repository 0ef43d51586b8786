"""hpm's memory as N grows: the global step (collect + layout + the small-data guard)
and the per-part mining, each N in a fresh process, on synthetic clustered vectors.

    .venv/bin/python tests/benchmarks/bench_hpm_memory.py --sizes 100000,300000

The hpm stage's code path without the runner: ``store.collect`` over parts of --part rows (what
the global step reads), ``pass_io.prepare_pass`` (k-means layout, sorted vectors, the guard),
then ``pass_io.Miner`` over every part in chunks of --chunk rows, as the stage's actors mine them
(one process here plays every actor in turn; results are dropped once their sizes are counted,
as the stage writes them to the part's table; --every n mines every n-th part only, which leaves
a chunk's memory as it is and saves time at 1M). The vectors are drawn part by part, so the
process never holds them all: its peak is the step's and the mining's. The vectors are dense clusters, so that most rows
have positives.candidates.max_pairs candidate pairs above the floors: the worst case for the
pairs' memory.

Printed per N: wall time and peak RSS (ru_maxrss of the process, which never goes down, read
after each phase) of the global step and of the mining, candidate pairs kept and cut, and the
ratio of each peak to the smallest N's. The goal: every process's peak at the
largest N within 1.3x of its peak at the smallest, beyond the memory-mapped vectors themselves
(which the page cache holds, shared by every actor of a node).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def centres(n: int, d: int, seed: int = 0) -> list[np.ndarray]:
    """n / 200 cluster centres per modality."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((max(1, n // 200), d)).astype(np.float32) for _ in range(2)]


def part_vectors(cs: list[np.ndarray], lo: int, hi: int, seed: int = 0) -> list[np.ndarray]:
    """Rows lo:hi (one part): unit vectors in tight clusters (cosine to their centre ~0.9), per
    modality, drawn from the part's own seed, so the process never holds every row."""
    rng = np.random.default_rng([seed, lo])
    lab = rng.integers(0, len(cs[0]), hi - lo)
    out = []
    for c in cs:
        d = c.shape[1]
        x = (c[lab] + 0.45 * rng.standard_normal((hi - lo, d), dtype=np.float32)) / np.sqrt(d)
        out.append(x / np.linalg.norm(x, axis=1, keepdims=True))
    return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Peaks:
    """The largest anonymous and file-backed RSS of this process (/proc/self/status, every
    20 ms): file-backed pages are the memory-mapped vectors, which the page cache holds once per
    node and can drop; anonymous memory is what the process itself allocated."""

    def __init__(self) -> None:
        self.anon = self.file = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def sample(self) -> None:
        with open("/proc/self/status") as fh:
            kb = {k: float(v.split()[0]) for k, v in (line.split(":", 1) for line in fh)
                  if k in ("RssAnon", "RssFile")}
        self.anon = max(self.anon, kb["RssAnon"] / 1024)
        self.file = max(self.file, kb["RssFile"] / 1024)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.sample()

    def take(self) -> tuple[float, float]:
        self.sample()
        out = (self.anon, self.file)
        self.anon = self.file = 0.0
        return out


def one(n: int, a: argparse.Namespace) -> dict:
    import pyarrow as pa
    from vlcurate.schemas import F
    from vlcurate.schemas import embed as E
    from vlcurate.stages.mining.engine import core
    from vlcurate.stages.mining.pass_io import Miner, prepare_pass
    from vlcurate.stages.mining.store import Store, collect

    from vlcurate.foundation.heap import bounded_heap
    cs = centres(n, a.dim)
    peaks = Peaks()
    base = peaks.take()[0]

    def read(part: int) -> pa.Table:
        lo, hi = part * a.part, min(n, (part + 1) * a.part)
        emb = {c: pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), a.dim)
               for c, x in zip((E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME), part_vectors(cs, lo, hi))}
        return pa.table({F.SAMPLE_ID.name: [f"s{i}" for i in range(lo, hi)], **emb,
                         F.ROW.name: pa.array(np.arange(hi - lo), pa.int64())})

    p = core.PassParams(k=a.k, tau_i=0.5, tau_t=0.5, dup=0.98, floor_i=a.floor,
                          floor_t=a.floor, probe=a.probe, max_pairs=a.max_pairs)
    parts = -(-n // a.part)
    with tempfile.TemporaryDirectory() as work:
        t = time.time()
        with bounded_heap() if not a.default_heap else contextlib.nullcontext():
            meta = collect(read, parts, work, (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME))
            state = prepare_pass(Store(meta), p, work, "cpu")     # as the executors run it
        t_step, step = time.time() - t, peaks.take()
        miner, kept, cut = Miner(state, "cpu"), 0, 0
        t = time.time()
        for part in range(0, parts, a.every):
            rows = np.arange(meta.starts[part], meta.starts[part] + meta.counts[part])
            for c in range(0, len(rows), a.chunk):
                r = miner.mine(rows[c:c + a.chunk])
                kept, cut = kept + len(r.pair_j), cut + int(r.cut.sum())
        t_mine = time.time() - t
        mine = peaks.take()
    return {"n": n, "clusters": p.clusters(n), "before_anon_mb": base, "every": a.every,
            "step_s": t_step, "step_anon_mb": step[0], "step_file_mb": step[1],
            "mine_s": t_mine, "mine_anon_mb": mine[0], "mine_file_mb": mine[1],
            "maxrss_mb": rss_mb(), "pairs_kept": kept, "pairs_cut": cut,
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,300000")
    ap.add_argument("--dim", type=int, default=32, help="per modality")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--probe", type=int, default=8)
    ap.add_argument("--max-pairs", type=int, default=256)
    ap.add_argument("--floor", type=float, default=0.6, help="positives.candidates.image/text")
    ap.add_argument("--part", type=int, default=10_000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--every", type=int, default=1,
                    help="mine every n-th part only (a chunk's memory does not depend on it)")
    ap.add_argument("--default-heap", action="store_true",
                    help="leave glibc's mmap threshold dynamic (before foundation.heap.bounded_heap)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a)))
        return
    rows = []
    for n in map(int, a.sizes.split(",")):
        args = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
                for k, v in vars(a).items() if k not in ("sizes", "one") and v is not False]
        out = subprocess.run([sys.executable, __file__, "--one", str(n), *args], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    first = rows[0]
    print(f"\n{'N':>9} {'clusters':>8} {'step s':>7} {'step anon':>9} {'step file':>9} "
          f"{'mine s':>7} {'mine anon':>9} {'mine file':>9} {'pairs kept':>11} {'pairs cut':>10} "
          f"{'load':>5}   (MB; anon = allocated, file = memory-mapped pages)")
    for r in rows:
        print(f"{r['n']:>9,} {r['clusters']:>8} {r['step_s']:>7.1f} {r['step_anon_mb']:>9,.0f} "
              f"{r['step_file_mb']:>9,.0f} {r['mine_s']:>7.1f} {r['mine_anon_mb']:>9,.0f} "
              f"{r['mine_file_mb']:>9,.0f} {r['pairs_kept']:>11,} {r['pairs_cut']:>10,} "
              f"{r['load']:>5.1f}")
    for r in rows[1:]:
        print(f"N x{r['n'] / first['n']:.0f}: anonymous peak x"
              f"{r['step_anon_mb'] / first['step_anon_mb']:.2f} (global step), x"
              f"{r['mine_anon_mb'] / first['mine_anon_mb']:.2f} (mining); before the step "
              f"{first['before_anon_mb']:,.0f} MB")

if __name__ == "__main__":
    main()
