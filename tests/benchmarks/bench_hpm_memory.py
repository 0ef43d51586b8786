"""hpm's memory as N grows (issue 14): the global step (collect + layout + the small-data guard)
and the per-part mining, each N in a fresh process, on synthetic clustered vectors.

    .venv/bin/python tests/benchmarks/bench_hpm_memory.py --sizes 100000,300000

The hpm stage's code path without the runner: ``store.collect`` over parts of --part rows (what
the global step reads), ``pass_io.prepare_pass`` (k-means layout, sorted vectors, the guard),
then ``pass_io.Miner`` over every part in chunks of --chunk rows, as the stage's actors mine them
(one process here plays every actor in turn; results are dropped once their sizes are counted,
as the stage writes them to the part's table). The vectors are dense clusters, so that most rows
have hpm.max_pairs candidate pairs above the floors: the worst case for the pairs' memory.

Printed per N: wall time and peak RSS (ru_maxrss of the process, which never goes down, read
after each phase) of the global step and of the mining, candidate pairs kept and cut, and the
ratio of each peak to the smallest N's. The goal (issue 14): every process's peak at the
largest N within 1.3x of its peak at the smallest, beyond the memory-mapped vectors themselves
(which the page cache holds, shared by every actor of a node).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def vectors(n: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors in n / 200 tight clusters (cosine to their centre ~0.9), per modality."""
    rng = np.random.default_rng(seed)
    c = max(1, n // 200)
    lab = rng.integers(0, c, n)
    out = []
    for _ in range(2):
        centre = rng.standard_normal((c, d)).astype(np.float32)
        x = centre[lab] / np.sqrt(d) + 0.45 * rng.standard_normal((n, d)).astype(np.float32) / np.sqrt(d)
        out.append(x / np.linalg.norm(x, axis=1, keepdims=True))
    return out[0], out[1]


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(n: int, a: argparse.Namespace) -> dict:
    import pyarrow as pa
    from vlcurate.schemas import F
    from vlcurate.schemas import embed as E
    from vlcurate.stages.mining import blocks
    from vlcurate.stages.mining.pass_io import Miner, prepare_pass
    from vlcurate.stages.mining.store import Store, collect

    img, txt = vectors(n, a.dim)
    base = rss_mb()

    def read(part: int) -> pa.Table:
        lo, hi = part * a.part, min(n, (part + 1) * a.part)
        emb = {c: pa.FixedSizeListArray.from_arrays(pa.array(x[lo:hi].ravel()), a.dim)
               for c, x in ((E.IMAGE_EMB_NAME, img), (E.TEXT_EMB_NAME, txt))}
        return pa.table({F.SAMPLE_ID.name: [f"s{i}" for i in range(lo, hi)], **emb,
                         F.ROW.name: pa.array(np.arange(hi - lo), pa.int64())})

    p = blocks.PassParams(k=a.k, tau_i=0.5, tau_t=0.5, dup=0.98, floor_i=a.floor,
                          floor_t=a.floor, probe=a.probe, max_pairs=a.max_pairs)
    parts = -(-n // a.part)
    with tempfile.TemporaryDirectory() as work:
        t = time.time()
        meta = collect(read, parts, work, (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME))
        del img, txt
        state = prepare_pass(Store(meta), p, work, "cpu")
        t_step, peak_step = time.time() - t, rss_mb()
        miner, kept, cut = Miner(state, "cpu"), 0, 0
        t = time.time()
        for part in range(parts):
            rows = np.arange(meta.starts[part], meta.starts[part] + meta.counts[part])
            for c in range(0, len(rows), a.chunk):
                r = miner.mine(rows[c:c + a.chunk])
                kept, cut = kept + len(r.pair_j), cut + int(r.cut.sum())
        t_mine = time.time() - t
    return {"n": n, "clusters": p.clusters(n), "before_mb": base, "step_s": t_step,
            "step_peak_mb": peak_step, "mine_s": t_mine, "mine_peak_mb": rss_mb(),
            "pairs_kept": kept, "pairs_cut": cut, "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,300000")
    ap.add_argument("--dim", type=int, default=32, help="per modality")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--probe", type=int, default=8)
    ap.add_argument("--max-pairs", type=int, default=256)
    ap.add_argument("--floor", type=float, default=0.6, help="hpm.pair_image/text")
    ap.add_argument("--part", type=int, default=10_000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one, a)))
        return
    rows = []
    for n in map(int, a.sizes.split(",")):
        args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                if k not in ("sizes", "one")]
        out = subprocess.run([sys.executable, __file__, "--one", str(n), *args], check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    first = rows[0]
    print(f"\n{'N':>9} {'clusters':>8} {'step s':>7} {'step peak MB':>12} {'mine s':>7} "
          f"{'mine peak MB':>12} {'pairs kept':>11} {'pairs cut':>10} {'load':>5}")
    for r in rows:
        print(f"{r['n']:>9,} {r['clusters']:>8} {r['step_s']:>7.1f} {r['step_peak_mb']:>12,.0f} "
              f"{r['mine_s']:>7.1f} {r['mine_peak_mb']:>12,.0f} {r['pairs_kept']:>11,} "
              f"{r['pairs_cut']:>10,} {r['load']:>5.1f}")
    for r in rows[1:]:
        print(f"N x{r['n'] / first['n']:.0f}: peak x{r['step_peak_mb'] / first['step_peak_mb']:.2f} "
              f"(global step), x{r['mine_peak_mb'] / first['mine_peak_mb']:.2f} (mining)")


if __name__ == "__main__":
    main()
