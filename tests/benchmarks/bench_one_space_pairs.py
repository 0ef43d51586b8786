"""Pairs near in one space only (an image near-duplicate under an unrelated caption, or the
reverse: FFF's main case) against the neighbour pass's routing on the joint vector, on the
real-derived set (bench_mining.py's ``real_pairs``) with planted pairs:

    .venv/bin/python tests/benchmarks/bench_one_space_pairs.py [--plants 300]

For each of --plants rows q, one new row j: an image plant has I_j = I_q + noise (S_I ~ 0.97)
and the caption of an unrelated row; a text plant has T_j = T_q + noise (S_T ~ 0.997) and an
unrelated image. Printed per (clusters, probe): the share of plants whose pair (q, j) is among
q's pass pairs (floors 0.9), and, for routing on each joint cluster's per-space member mean
instead, the share of j's clusters ranked within the top 10/20/40/80 by <q, mean>. Why
positives keeps its own per-space search when hpm's pass is partial (positives_stage.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.benchmarks.bench_mining import real_pairs  # noqa: E402


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def planted(img, txt, m: int, seed: int = 0):
    """The set with m image plants then m text plants appended; (vectors, q rows, j rows)."""
    n, rng = len(img), np.random.default_rng(seed)
    q, other = rng.choice(n, 2 * m, replace=False), rng.choice(n, 2 * m, replace=False)
    noise = rng.standard_normal((2 * m, img.shape[1])).astype(np.float32)
    ni = np.vstack([unit(img[q[:m]] + 0.012 * noise[:m]), img[other[m:]]])
    nt = np.vstack([txt[other[:m]], unit(txt[q[m:]] + 0.004 * noise[m:])])
    return np.vstack([img, ni]), np.vstack([txt, nt]), q, n + np.arange(2 * m)


def found_share(I, T, q, j, clusters: int, probe: int, space_probe: int = 0):
    """(hit per plant, rows scored per target, joint layout, seconds to mine the targets)."""
    from vlcurate.stages.mining import engine as E
    from vlcurate.stages.mining.engine import core, layout, persist
    from vlcurate.stages.mining.engine import spaces as S
    p = core.PassParams(k=10, tau_i=0.5, tau_t=0.5, floor_i=0.9, floor_t=0.9, max_pairs=256,
                     n_clusters=clusters, probe=probe, space_probe=space_probe)
    lay = layout.build_layout(I, T, p)
    vec = persist.sorted_vectors(lay, I, T)
    sp = S.layouts(vec, p) if space_probe else []
    t0 = time.perf_counter()
    r = E.mine(lay, vec, lay.positions()[q], p, spaces=sp)
    dt = time.perf_counter() - t0
    hit = np.array([j[k] in set(r.pair_j[r.offsets[k]:r.offsets[k + 1]].tolist())
                    for k in range(len(q))])
    return hit, r.scored / len(q), lay, dt


def mean_rank(lay, X, q, j) -> np.ndarray:
    """Rank of j's cluster among all clusters by <x_q, mean of the cluster's members' x>."""
    cl = lay.cluster_of(lay.positions())
    means = np.zeros((lay.n_clusters, X.shape[1]))
    np.add.at(means, cl, X)
    s = X[q] @ means.T / np.maximum(np.bincount(cl, minlength=lay.n_clusters), 1)
    return (s > s[np.arange(len(q)), cl[j]][:, None]).sum(1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plants", type=int, default=300)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/vlcurate_bench"))
    # clusters:probe[:space_probe] (space_probe: one-space layouts, spaces.py)
    ap.add_argument("--settings", nargs="+", default=[
        "128:16", "128:16:4", "128:16:8", "128:16:16", "256:40", "256:40:16"])
    a = ap.parse_args()
    torch.set_num_threads(2)
    img, txt = real_pairs(a.cache)
    I, T, q, j = planted(img, txt, a.plants)
    m = a.plants
    print(f"{len(img)} real rows + {2 * m} plants; S_I of image plants median "
          f"{np.median((I[q[:m]] * I[j[:m]]).sum(1)):.3f} (S_T "
          f"{np.median((T[q[:m]] * T[j[:m]]).sum(1)):.3f}); S_T of text plants median "
          f"{np.median((T[q[m:]] * T[j[m:]]).sum(1)):.4f}")
    for setting in a.settings:
        c, probe, *sp = map(int, setting.split(":"))
        hit, rows, lay, dt = found_share(I, T, q, j, c, probe, sp[0] if sp else 0)
        print(f"clusters {c}, probe {probe}, space_probe {sp[0] if sp else 0} ({rows:.0f} joint "
              f"rows per target, {1e3 * dt / len(q):.2f} ms per target): found "
              f"{hit[:m].mean():.3f} of image plants, {hit[m:].mean():.3f} of text plants")
        if sp:
            continue
        for name, X, sl in (("image", I, slice(0, m)), ("text", T, slice(m, 2 * m))):
            rank = mean_rank(lay, X, q[sl], j[sl])
            print(f"  routing on per-space cluster means, {name} plants: j's cluster within "
                  + ", ".join(f"top {t} {np.mean(rank < t):.3f}" for t in (10, 20, 40, 80)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
