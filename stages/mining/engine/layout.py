"""The pass's layout: spherical k-means of the joint vectors j = [I; T] / sqrt(2) (for unit I,
T: <j_a, j_b> = m = (S_I + S_T) / 2) on a seeded sample, every row assigned to its nearest
centroid (above TWO_LEVEL_WORK rows x clusters: two levels, ``Centroids``), rows sorted by
(cluster, row) so that a cluster is a contiguous slice; per cluster its member mean mu_c and
radius r_c = max ||j - mu_c||. The GEMMs that assign rows are the precision's
(precision.Precision.nearest): they only decide where rows sit, the means and radii are fp32
sums of the actual members."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .. import native
from ..hpm import as_tensor
from .core import PassParams, _rows, cache_rows
from .kernels import assignment_step, nearest  # noqa: F401  (nearest: layout.nearest)
from .precision import Precision, get


@dataclass
class Layout:
    """Rows sorted by cluster: sorted position p holds global row order[p]; cluster c is
    positions bounds[c]:bounds[c+1], with member mean means[c] and radius radius[c]. What a
    worker needs to mine any rows (engine.mine): O(C x D + N) numbers, no routing table."""
    means: np.ndarray         # [C, D] member means
    radius: np.ndarray        # [C]
    order: np.ndarray         # [N] int64
    bounds: np.ndarray        # [C + 1] int64
    _on: dict = field(default_factory=dict, repr=False, compare=False)   # tensors: cached

    def order_on(self, device: str) -> torch.Tensor:
        """``order`` as a tensor on ``device``: one copy per device, kept (a GPU maps a unit's
        top-k to global rows where it merges them)."""
        return self.cached("order", device, "", lambda: self.order)

    def kept(self, key: tuple, make):
        """``make()``, made once per key and kept (a precision's copy of the means)."""
        if key not in self._on:
            self._on[key] = make()
        return self._on[key]

    def cached(self, name: str, device, tag: str, make, dtype=None) -> torch.Tensor:
        """The array ``make()`` as a tensor on ``device`` (in ``dtype``), made once per name,
        device and tag and kept: routing reads the means and radii once per chunk."""
        key = (name, str(device), tag)
        if key not in self._on:
            with warnings.catch_warnings():          # a read-only memmap is shared, never written
                warnings.simplefilter("ignore", UserWarning)
                self._on[key] = torch.as_tensor(np.asarray(make()), device=device, dtype=dtype)
        return self._on[key]

    @property
    def n_clusters(self) -> int:
        return len(self.bounds) - 1

    def cluster_of(self, pos: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.bounds, pos, side="right") - 1

    def positions(self) -> np.ndarray:
        """Sorted position of each global row (the inverse of ``order``)."""
        pos = np.empty(len(self.order), np.int64)
        pos[self.order] = np.arange(len(self.order))
        return pos


def joint_t(i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.cat([i, t], 1).div_(math.sqrt(2.0))     # in place: no second [n, D] array


def space_t(i: torch.Tensor, t: Optional[torch.Tensor]) -> torch.Tensor:
    """The vectors a layout clusters: joint [I; T] / sqrt(2), or one space's alone (t None:
    spaces.py)."""
    return i if t is None else joint_t(i, t)


def _chunks(img, txt, device: str, chunk: int = 32768):
    """Per chunk of rows (in table order): (first row, their joint vectors, or img's alone when
    txt is None)."""
    for a in range(0, len(img), chunk):
        yield a, space_t(_rows(img, a, a + chunk, device),
                         None if txt is None else _rows(txt, a, a + chunk, device))


MAX_SAMPLE = 1 << 17   # k-means training rows at most (p.sample per cluster below that)


def _spherical(x: torch.Tensor, c: int, rng, iters: int, prec: Precision) -> torch.Tensor:
    """Spherical k-means of the rows x from c seeded starting rows; unit centroids [c, D]
    (fp32; assignments by ``prec``'s GEMMs)."""
    cent = x[torch.as_tensor(np.sort(rng.choice(len(x), size=c, replace=False)), device=x.device)]
    xs = prec.assigned(x)
    for _ in range(iters):
        lab = prec.nearest(xs, cent)
        s = torch.zeros_like(cent).index_add_(0, lab, x)
        empty = s.norm(dim=1) == 0
        s[empty] = cent[empty]                       # an empty cluster keeps its centroid
        cent = s / s.norm(dim=1, keepdim=True)
    return cent


# rows x clusters (a flat assignment's dot products) above which the layout has two levels:
# ~3M rows in the default clusters of ~256 rows (11,600 clusters)
TWO_LEVEL_WORK = 1 << 35


COARSE_PROBE = 8     # coarse clusters whose fine centroids a row is compared with


@dataclass
class Centroids:
    """The layout's k-means centroids [C, D]. Above TWO_LEVEL_WORK they have two levels
    (hierarchical k-means): ~sqrt(C) coarse centroids of the sample, then each coarse cluster's
    sample rows split into its share of C (fine centroids grouped by coarse centroid: group g
    is fine[start[g]:start[g + 1]]). A row is assigned to the nearest fine centroid of its
    COARSE_PROBE nearest coarse ones: ~(1 + COARSE_PROBE) sqrt(C) dot products instead of C,
    so assignment grows as N sqrt(N), not N^2, when clusters keep their size. A row that misses
    its nearest fine centroid only sits in another cluster (member means and radii are those
    of the actual members, so routing and the certificate hold), but recall pays for it.
    Measured at 1M synthetic rows forced to 3,906 clusters, probe 80 (bench_mining.py, 300
    exact targets): layout 98 s flat, 30 s with COARSE_PROBE 4 and 37 s with 8; recall@10
    0.9925 flat, 0.982 (4), 0.985 (8), and 0.990 with flat assignment to the hierarchical
    centroids (their training costs ~0.003). Hence two levels only where a flat assignment
    costs too much: N x C > TWO_LEVEL_WORK (C x N dot products: ~40 s at 4M rows and 2,048 rows
    per cluster on 2 cores, ~4 min at 4.2M and 512 rows per cluster, seconds on a GPU)."""
    fine: torch.Tensor
    coarse: Optional[torch.Tensor] = None
    start: Optional[np.ndarray] = None
    precision: Precision = get("fp32")     # the assignment GEMMs' (nearest)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        if self.coarse is None:
            return self.precision.nearest(x, self.fine)
        x = x.to(self.precision.coarse_dtype)
        top = (x @ self.coarse.to(x.dtype).T).topk(min(COARSE_PROBE, len(self.coarse)),
                                                      dim=1).indices
        best = torch.full((len(x),), -math.inf, device=x.device)
        out = torch.empty(len(x), dtype=torch.long, device=x.device)
        for g in top.T:                             # nearest coarse cluster first: it wins ties
            score, fine = self._within(x, g)
            better = score > best
            best, out = torch.where(better, score, best), torch.where(better, fine, out)
        return out

    def _within(self, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's best fine centroid in coarse group g[i]: (similarity, fine index)."""
        score, fine = torch.empty(len(x), device=x.device), torch.empty_like(g)
        order = torch.argsort(g, stable=True)
        ends = np.cumsum(torch.bincount(g, minlength=len(self.coarse)).tolist())
        cent = self.fine.to(x.dtype)
        for gi, (e0, e1) in enumerate(zip(np.r_[0, ends[:-1]], ends)):
            rows, a = order[e0:e1], int(self.start[gi])
            v, i = (x[rows] @ cent[a:self.start[gi + 1]].T).max(1)
            score[rows], fine[rows] = v.float(), i + a
        return score, fine


def _shares(n_g: np.ndarray, c: int) -> np.ndarray:
    """c clusters split over groups in proportion to their rows n_g (largest remainders), every
    group with rows at least 1, none more than its rows."""
    want = c * n_g / n_g.sum()
    out = np.maximum(np.floor(want).astype(np.int64), (n_g > 0).astype(np.int64))
    rest = c - int(out.sum())
    if rest > 0:
        out[np.argsort(out - want, kind="stable")[:rest]] += 1
    return np.minimum(out, n_g)


def kmeans(img, txt, c: int, p: PassParams, device: str = "cpu") -> Centroids:
    """Spherical k-means on a seeded sample of the joint vectors (p.sample rows per cluster, at
    most MAX_SAMPLE); above n x c = TWO_LEVEL_WORK, two levels (Centroids): ~sqrt(c) coarse
    clusters of the sample, then each coarse cluster's rows split into its share of c."""
    n = len(img)
    rng = np.random.default_rng(p.seed)
    pick = np.sort(rng.choice(n, size=min(n, p.sample * c, max(MAX_SAMPLE, c)), replace=False))
    x = space_t(as_tensor(img[pick], device), None if txt is None else as_tensor(txt[pick], device))
    prec = get(p.precision)
    if n * c <= TWO_LEVEL_WORK:
        return Centroids(_spherical(x, c, rng, p.iters, prec), precision=prec)
    coarse = _spherical(x, math.isqrt(c), rng, p.iters, prec)
    g = prec.nearest(x, coarse)
    share = _shares(torch.bincount(g, minlength=len(coarse)).cpu().numpy(), c)
    fine = [_spherical(x[g == gi], int(k), rng, p.iters, prec) for gi, k in enumerate(share) if k]
    return Centroids(torch.cat(fine), coarse[torch.as_tensor(share > 0, device=device)],
                     np.cumsum(np.r_[0, share[share > 0]]), prec)


def build_layout(img, txt, p: PassParams, device: str = "cpu") -> Layout:
    """k-means, assignment, member means and radii (two streaming reads of the vectors; memory
    O(N) indices + O(C x D)). Routing is per query, where the query is mined (``route``)."""
    n = len(img)
    c = p.clusters(n)
    with torch.no_grad():
        cent = kmeans(img, txt, c, p, device)
        c = len(cent.fine)
        lab = torch.empty(n, dtype=torch.long, device=device)     # one array: no heap holes
        sums = torch.zeros(cent.fine.shape, dtype=torch.float64, device=device)
        for a, x in _chunks(img, txt, device):            # assignment and member sums: one read
            lab[a:a + len(x)] = cent.nearest(x)
            if native.add_rows(x, lab[a:a + len(x)], sums):   # in C: the same sums
                continue
            for b, xb in _pieces(x):                      # rows in order: the same sums
                sums.index_add_(0, lab[a + b:a + b + len(xb)], xb.double())
        labt, lab = lab, lab.cpu().numpy()
        order = np.lexsort((np.arange(n), lab)).astype(np.int64)   # by cluster, then row
        bounds = np.searchsorted(lab[order], np.arange(c + 1)).astype(np.int64)
        size = torch.as_tensor(np.diff(bounds), device=device).clamp(min=1).unsqueeze(1)
        means = (sums / size).float()
        radius = torch.zeros(c, device=device)
        for a, x in _chunks(img, txt, device):
            for b, xb in _pieces(x):
                la = labt[a + b:a + b + len(xb)]
                radius = radius.scatter_reduce(0, la, (xb - means[la]).norm(dim=1), "amax")
    return Layout(means.cpu().numpy(), radius.cpu().numpy(), order, bounds)


def _pieces(x: torch.Tensor):
    """(first row, rows) of x a cache-sized piece at a time (core.cache_rows: its float64 and
    gathered temporaries stay in cache, ~3-4x faster than a 32,768-row chunk's)."""
    step = cache_rows(x)
    for b in range(0, len(x), step):
        yield b, x[b:b + step]
