"""The small numeric pieces below every precision, the layout and routing: the assignment's
GEMM (``nearest``), a cluster's spread and the routing bias, a row's own column first, and
read-only memory maps. Nothing here imports another module of the engine, so that the
precisions (precision.py, the int8 package) sit below the layout, routing and persistence that
use them."""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch


def nearest(x: torch.Tensor, cent: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """argmax_c <x_i, cent_c>, a few rows at a time: the scores held are ~4M floats, whatever
    the number of clusters (C grows with N). ``dtype``: the GEMM's (hpm.engine.precision bf16: ~3x
    fp32's rate on a CPU with AVX512-BF16 or AMX; the layout only decides where rows sit,
    member means and radii are fp32 sums of the actual members, so routing and the
    certificate hold whatever the assignment; int8 has its own: precision.Precision.nearest)."""
    step, out = assignment_step(cent), torch.empty(len(x), dtype=torch.long, device=x.device)
    cent = cent.to(dtype)
    for a in range(0, len(x), step):
        torch.argmax(x[a:a + step].to(dtype) @ cent.T, 1, out=out[a:a + step])
    return out


def assignment_step(cent: torch.Tensor) -> int:
    """Rows assigned at a time: ~4M scores held, whatever the number of centroids."""
    return max(256, (1 << 22) // max(len(cent), 1))


# Routing ranks clusters by <q, mu_c> + ROUTE_SPREAD * spread_c, not <q, mu_c> alone: a loose
# cluster (small |mu_c|) reaches further from its mean than a tight one with the same <q, mu_c>.
# For unit vectors spread_c = sqrt(1 - |mu_c|^2) is its members' RMS distance from mu_c, so
# their best <q, j> is ~<q, mu_c> + sqrt(2 ln n_c / D_eff) spread_c for isotropic residuals in
# D_eff dimensions: a coefficient of ~0.3-0.6 for 256 members and D_eff of 60-120. Measured on
# the 1M synthetic set (clusters of ~256 rows, 2,000 exact targets, the true pairs among each
# top 50): the share of pairs whose cluster is probed at probe 40 / 60 / 80 is
# 0.9861 / 0.9908 / 0.9934 by <q, mu_c>, 0.9894 / 0.9933 / 0.9954 with 0.5 (flat from 0.4 to
# 0.6; 1.0 is worse); with 0.5, probe 60 (18.9k rows scored per target) finds what probe 80
# found by <q, mu_c> (23.6k rows). bench_mining.py prints the same comparison for its exact
# targets ("exact pairs in probed clusters"). One-space layouts (spaces.py), a row's virtual
# near-duplicate at S ~0.905 (its floor 0.9; 4,000 rows): its cluster is among the 4 / 8
# ranked best for 0.987 / 0.998 of them, against 0.962 / 0.989 by <q, mu_c> (bench_mining.py:
# "one-space routing", for its exact targets).
ROUTE_SPREAD = 0.5


def spread(lay: Any) -> np.ndarray:
    """[C] sqrt(1 - |mu_c|^2): the RMS distance of a cluster's (unit) members from their mean
    (0 for an empty cluster)."""
    return np.sqrt(np.clip(1.0 - np.square(lay.means, dtype=np.float64).sum(1), 0.0, None)
                   ).astype(np.float32) * (np.diff(lay.bounds) > 0)


def _bias(lay: Any, device) -> torch.Tensor:
    return lay.cached("bias", device, "fp32", lambda: np.where(
        np.diff(lay.bounds) == 0, -np.inf, ROUTE_SPREAD * spread(lay)).astype(np.float32))


def _first(m: torch.Tensor, own: Optional[np.ndarray]) -> torch.Tensor:
    """Scores m with +inf at each row's own column (None: m as it is)."""
    if own is None:
        return m
    return m.scatter_(1, torch.as_tensor(own, device=m.device)[:, None], math.inf)


def mapped(path: str, dtype, shape: tuple) -> np.ndarray:
    """A file's read-only memory map as a plain ndarray view (the map lives as its base): a
    slice of it costs ~0.3 us, an np.memmap's ~18 (its __getitem__ and __array_finalize__ in
    Python; a unit takes ~4 slices: ~4% of the int8 pass)."""
    return np.asarray(np.memmap(path, dtype, "r", shape=shape))
