"""One neighbour pass in dense blocks: HELIP hard pairs (Alg. 1 score and thresholds),
noise support, near-duplicates and FFF Eq. 1 candidate pairs with their exact similarities.

Layout (``build_layout``): spherical k-means of the joint vectors j = [I; T] / sqrt(2) (for unit
I, T: <j_a, j_b> = m = (S_I + S_T) / 2) on a seeded sample, every row assigned to its nearest
centroid (above TWO_LEVEL_WORK rows x clusters: two levels, ``Centroids``), rows sorted by (cluster, row) so that a cluster is a contiguous slice. Per cluster:
its member mean mu_c and radius r_c = max ||j - mu_c||.

Mining rows (``mine``, wherever they are: the hpm stage mines each chunk of each part on its
actor pool): each row (query) is routed to the ``probe`` clusters ranked best for its joint
vector (``mean_scores``: the similarity to a cluster's mean plus a share of its members' spread
about it), its own among them (IVF's nprobe, with exact scores). Grouped by cluster, this
gives the units of work (``run_unit``): cluster c and the queries routed to it; small units
(clusters of a few hundred rows, or few queries each) run stacked, many per candidate pass
(``stacks``, ``run_stack``). Scores are exact fp32
GEMMs of the gathered queries (query_block at a time) against c's members (a contiguous slice,
block_size at a time; no PQ): S_I and S_T of every (query, member) pair, then

* the HPM score s = S~I * S~T with Alg. 1's thresholds and the duplicate rule, for the pairs
  with s > 0 only (screen.block_pairs: one boolean mask over the block, then only the few
  pairs it lists; in bf16 with an fp32 re-score, hpm.precision), kept as lists cut to each
  query's best k (``Best``), and its support (pairs with s > 0 among c's members);
* every pair with S_I > floor_i or S_T > floor_t (with cross-modal vectors also X_ii > floor_i,
  X_tt > floor_t or S_it = <x_i, t_j> > floor_x): the candidates of FFF Eq. 1 (in the space the
  positives stage judges it: the cross-modal one when there is one) and of HELIP's duplicates,
  kept with their exact similarities.

``gather`` merges each query's ``probe`` partial top-k lists (canonical order: score, then lower
global row), sums its supports (clusters are disjoint, so nothing is counted twice) and caps its
pairs. A row's result depends only on the layout and its own routing, not on which rows are
mined with it, on which worker, or in which order - up to the last bits of its scores (a GEMM's
rounding depends on its shape; the runner's chunks are fixed, run.chunk_rows, so that never
depends on resources). At an exact tie at the k-th place the lower global row is kept, as
exact HPM keeps it (``Best`` sorts stably by score, then global row).

Certificate (a proof, not an estimate): a row of a cluster c' that q did not search has joint
similarity <q, mu_c'> + <q, j - mu_c'> <= <q, mu_c'> + r_c' (|q| = 1). With m_out the largest
such bound over the clusters q did not search, no pair left out scores more than
hpm.score_bound(m_out). A target is certified when its k-th score is >= that bound (its top-k
is exact) or the bound is 0 (no pair left out can score > 0: top-k, support and the noise
decision are all exact). With probe = every cluster the pass is exhaustive: exact HPM.
The bound needs only to fall below the k-th score found (not the top-1), yet in 768 d a
cluster's radius is close to 1 (its farthest member is nearly orthogonal to its mean), so with
probe < all clusters it certifies almost no target (0% on the 200k and 1M synthetic sets, see
tests/benchmarks/bench_mining.py): it is a proof (precision 100%, tested at k = 5 and 500),
not a recall estimate; recall at the defaults is measured there instead.

Memory: the layout is O(N) indices plus O(C x D) means; mining q rows holds q x (k + max_pairs)
results (pairs are capped per row as member blocks arrive, whatever a cluster's size) and
query_block x block_size scores (plus slices of the memory-mapped sorted vectors),
whatever N is. No process ever holds the pass's whole output.
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np
import torch

from vlcurate.pipeline import heap

from . import native, q8, screen
from .hpm import as_tensor, positive_scores, score_bound


# while a chunk is mined: M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD
_KEEP = {heap.M_MMAP_THRESHOLD: 32 << 20, heap.M_TRIM_THRESHOLD: 256 << 20,
         heap.M_TOP_PAD: 64 << 20}


def freed_memory_kept():
    """glibc, while a chunk is mined: blocks under 32 MB come from the heap, and up to 256 MB
    freed at its top stay there. By default every tensor over ~128 KB is a fresh mmap whose
    pages fault in again, and the pass makes thousands of ~1 MB temporaries per chunk: ~15%
    of its time per target (1M synthetic). Speed only. On exit the enclosing settings come back
    (pipeline/heap.py: left set, every later stage of an in-process run held ~0.5 GB more:
    bench_scale at 100k) and the free memory is given back (malloc_trim)."""
    return heap.heap_settings(_KEEP, trim=True)


SLACK = 1e-5          # fp32 rounding of <q, mu> + r: the certificate's bound is raised by this
# a candidate pair's similarities: S_I, S_T (HELIP's encoders), and with cross-modal vectors the
# directed S_it = <x_i, t_j>, X_ii = <x_i, x_j>, X_tt = <t_i, t_j> (NaN without them)
SIMS = ("sii", "stt", "sit", "xii", "xtt")
PAIR_FIELDS = ("q", "j") + SIMS
NAMES = ("img", "txt", "ximg", "xtxt")     # the sorted vectors (files img.f32, ...)


@dataclass(frozen=True)
class PassParams:
    k: int
    tau_i: float
    tau_t: float
    dup: Optional[float] = 0.98
    floor_i: float = 2.0           # keep pairs with S_I > floor_i (2.0: none)
    floor_t: float = 2.0
    floor_x: float = 2.0           # S_it > floor_x (needs cross-modal vectors; X_ii and X_tt
                                   # are held to floor_i and floor_t)
    n_clusters: Optional[int] = None   # None: auto (clusters of about cluster_rows rows)
    probe: int = 40                # clusters searched per query (all: exhaustive)
    iters: int = 6                 # k-means iterations: 10 -> 6 cost 0.0004 of recall@10 on
                                   # 2,000 exact targets of the 1M synthetic set (probe 60:
                                   # 0.9934 -> 0.9930; 4: 0.9920) and ~40% of k-means' time
    sample: int = 64               # k-means training rows per cluster
    seed: int = 0
    query_block: int = 1024
    block_size: int = 8192
    max_pairs: Optional[int] = None    # candidate pairs kept per row (highest similarity first)
    precision: str = "fp32"        # the blocks' GEMMs: fp32, or a bf16 / int8 screen (screen.py)
    space_probe: int = 0           # one-space layouts' clusters searched per row (spaces.py;
                                   # 0: none)
    cluster_rows: int = 2048       # the auto cluster size
    space_rows: int = 512          # the one-space layouts' cluster size (spaces.py)
    exact_noise: bool = True       # complete the support of rows found short (``complete``):
                                   # noise decisions equal exact HPM's

    def floors(self) -> dict:
        """Each similarity's candidate floor (X_ii and X_tt share S_ii's and S_tt's)."""
        return {"sii": self.floor_i, "stt": self.floor_t, "sit": self.floor_x,
                "xii": self.floor_i, "xtt": self.floor_t}

    def clusters(self, n: int) -> int:
        c = self.n_clusters or max(1, round(n / self.cluster_rows))
        return max(1, min(c, n))


@dataclass
class Layout:
    """Rows sorted by cluster: sorted position p holds global row order[p]; cluster c is
    positions bounds[c]:bounds[c+1], with member mean means[c] and radius radius[c]. What a
    worker needs to mine any rows (``mine``): O(C x D + N) numbers, no routing table."""
    means: np.ndarray         # [C, D] member means
    radius: np.ndarray        # [C]
    order: np.ndarray         # [N] int64
    bounds: np.ndarray        # [C + 1] int64
    _on: dict = field(default_factory=dict, repr=False, compare=False)   # tensors: cached

    def order_on(self, device: str) -> torch.Tensor:
        """``order`` as a tensor on ``device``: one copy per device, kept (a GPU maps a unit's
        top-k to global rows where it merges them)."""
        return self.cached("order", device, "", lambda: self.order)

    def low_means(self, device) -> q8.Q8:
        """The member means in int8, one scale for all (q8.shared), made once per device."""
        key = ("low_means", str(device), "int8")
        if key not in self._on:
            self._on[key] = q8.shared(as_tensor(self.means, device))
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


def _rows(x, a: int, b: int, device: str) -> torch.Tensor:
    return as_tensor(x[a:b], device)


def _whole(x) -> torch.Tensor:
    """x as an fp32 tensor where it lies (a device's copy, or a memmap's pages on the host,
    shared)."""
    return as_tensor(x, x.device if isinstance(x, torch.Tensor) else "cpu")


def _chunks(img, txt, device: str, chunk: int = 32768):
    """Per chunk of rows (in table order): (first row, their joint vectors, or img's alone when
    txt is None)."""
    for a in range(0, len(img), chunk):
        yield a, space_t(_rows(img, a, a + chunk, device),
                         None if txt is None else _rows(txt, a, a + chunk, device))


def gemm_dtype(precision: str) -> torch.dtype:
    """The float dtype of the GEMMs that only decide where to search under hpm.precision (the
    layout's assignments, routing; int8 has its own, and bf16 for a two-level layout's
    coarse centroids): fp32, or the screen's low dtype."""
    return torch.float32 if precision == "fp32" else screen.LOW[screen.decision(precision)][0]


def layout_dtype(precision: str) -> torch.dtype:
    """The k-means and flat assignment GEMMs' dtype: int8 for int8 (``nearest``; two-level
    layouts score their coarse centroids in bf16), else gemm_dtype's."""
    return torch.int8 if precision == "int8" else gemm_dtype(precision)


MAX_SAMPLE = 1 << 17   # k-means training rows at most (p.sample per cluster below that)


def nearest(x: torch.Tensor, cent: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """argmax_c <x_i, cent_c>, a few rows at a time: the scores held are ~4M floats, whatever
    the number of clusters (C grows with N). ``dtype``: the GEMM's (hpm.precision bf16: ~3x
    fp32's rate on a CPU with AVX512-BF16 or AMX; the layout only decides where rows sit,
    member means and radii are fp32 sums of the actual members, so routing and the
    certificate hold whatever the assignment)."""
    step = max(256, (1 << 22) // max(len(cent), 1))
    out = torch.empty(len(x), dtype=torch.long, device=x.device)
    if dtype == torch.int8:
        return _nearest_int8(x, cent, step, out)
    cent = cent.to(dtype)
    for a in range(0, len(x), step):
        torch.argmax(x[a:a + step].to(dtype) @ cent.T, 1, out=out[a:a + step])
    return out


def _nearest_int8(x: torch.Tensor, cent: torch.Tensor, step: int, out: torch.Tensor
                  ) -> torch.Tensor:
    """``nearest`` by int8 GEMMs (hpm.precision int8): the centroids quantized with one scale,
    each row with its own (a row's positive scale changes no argmax), int32 sums. ~2.6x the
    bf16 assignment's speed on this machine (131k rows x 3,906 centroids: 1.45 s against
    3.8), and nearer fp32's choice (99.1% of rows against bf16's 98.4%)."""
    c8 = q8.scaled(cent, cent.abs().max())
    for a in range(0, len(x), step):
        xa = x[a:a + step]
        rows = xa if xa.dtype == torch.int8 else _rows8(xa)
        torch.argmax(q8.int_mm(rows, c8), 1, out=out[a:a + step])
    return out


def _rows8(x: torch.Tensor) -> torch.Tensor:
    """Rows quantized for an int8 assignment, each with its own scale."""
    return q8.scaled(x, q8.abs_max(x)[:, None])


def _assigned_as(x: torch.Tensor, dtype) -> torch.Tensor:
    """The rows k-means assigns, as ``nearest`` reads them: int8 rows quantized once for
    every iteration (the same values each time; a few rows at a time: bounded temporaries)."""
    if dtype != torch.int8:
        return x
    return torch.cat([_rows8(x[a:a + 4096]) for a in range(0, len(x), 4096)] +
                     [torch.zeros((0, x.shape[1]), dtype=torch.int8, device=x.device)])


def _spherical(x: torch.Tensor, c: int, rng, iters: int, dtype=torch.float32) -> torch.Tensor:
    """Spherical k-means of the rows x from c seeded starting rows; unit centroids [c, D]
    (fp32; assignments by GEMMs in ``dtype``)."""
    cent = x[torch.as_tensor(np.sort(rng.choice(len(x), size=c, replace=False)), device=x.device)]
    xs = _assigned_as(x, dtype)
    for _ in range(iters):
        lab = nearest(xs, cent, dtype)
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
    dtype: torch.dtype = torch.float32      # the assignment GEMMs' (nearest)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        if self.coarse is None:
            return nearest(x, self.fine, self.dtype)
        x = x.to(torch.bfloat16 if self.dtype == torch.int8 else self.dtype)
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
    dtype = layout_dtype(p.precision)
    if n * c <= TWO_LEVEL_WORK:
        return Centroids(_spherical(x, c, rng, p.iters, dtype), dtype=dtype)
    coarse = _spherical(x, math.isqrt(c), rng, p.iters, dtype)
    g = nearest(x, coarse, dtype)
    share = _shares(torch.bincount(g, minlength=len(coarse)).cpu().numpy(), c)
    fine = [_spherical(x[g == gi], int(k), rng, p.iters, dtype) for gi, k in enumerate(share) if k]
    return Centroids(torch.cat(fine), coarse[torch.as_tensor(share > 0, device=device)],
                     np.cumsum(np.r_[0, share[share > 0]]), dtype)


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
    """(first row, rows) of x a cache-sized piece at a time (q8.cache_rows: its float64 and
    gathered temporaries stay in cache, ~3-4x faster than a 32,768-row chunk's)."""
    step = q8.cache_rows(x)
    for b in range(0, len(x), step):
        yield b, x[b:b + step]


def route_step(lay: Layout) -> int:
    """Queries routed at a time: ~4M scores held, whatever the number of clusters."""
    return max(256, (1 << 22) // max(lay.n_clusters, 1))


def route(lay: Layout, vec: "Vectors", pos: np.ndarray, probe: int, device: str = "cpu",
          precision: str = "fp32", qc: Optional["Queries"] = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """For the queries at sorted positions ``pos``: their ``probe`` best non-empty clusters by
    ``mean_scores`` (their own among them; equal scores by the lower cluster; ascending), and
    m_out = max over the other non-empty clusters of <q, mu_c> + r_c (+ SLACK, and the screen's
    margin with a low ``precision``; -inf when none), the certificate's bound. Routed
    route_step queries at a time (a row's routing is its own). ``qc``: Queries holding every
    row of ``pos``, whose compact copy is read instead of N rows."""
    step = route_step(lay)
    parts = [_route(lay, vec, pos[a:a + step], probe, device, precision, qc)
             for a in range(0, max(len(pos), 1), step)]
    return np.concatenate([t for t, _ in parts]), np.concatenate([m for _, m in parts])


def _route(lay: Layout, vec: "Vectors", pos: np.ndarray, probe: int, device: str,
           precision: str, qc: Optional["Queries"] = None) -> tuple[np.ndarray, np.ndarray]:
    probe = min(probe, lay.n_clusters)
    x = joint_t(*(qc.full_rows(pos, x) if qc else _take(getattr(vec, x), pos, device)
                  for x in ("img", "txt")))
    own = lay.cluster_of(pos)
    reach = lay.cached("reach", device, "fp32", lambda: lay.radius - ROUTE_SPREAD * spread(lay))
    # its own cluster first (+inf); the others' best <q, mu_c> + r_c: the certificate's bound
    if precision == "int8":
        (top, m_out), err = int8_top(lay, x, probe, own, reach)
    else:
        m, err = routing_scores(lay, x, precision)
        top, m_out = native.top_columns(_first(m, own), probe, reach)
    m_out = np.where(np.isfinite(m_out), m_out + (SLACK + err), -np.inf).astype(np.float32)
    return top, m_out


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


def spread(lay: Layout) -> np.ndarray:
    """[C] sqrt(1 - |mu_c|^2): the RMS distance of a cluster's (unit) members from their mean
    (0 for an empty cluster)."""
    return np.sqrt(np.clip(1.0 - np.square(lay.means, dtype=np.float64).sum(1), 0.0, None)
                   ).astype(np.float32) * (np.diff(lay.bounds) > 0)


def mean_scores(lay: Layout, x: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """[n, C] fp32 routing scores <x_i, mu_c> + ROUTE_SPREAD spread_c of query vectors x
    against every cluster's member mean (joint vectors, or one space's: spaces.py), -inf for
    an empty cluster: one GEMM with the spreads (and the empty clusters) as its bias."""
    return routing_scores(lay, x, precision)[0]


def routing_scores(lay: Layout, x: torch.Tensor, precision: str = "fp32") -> tuple:
    """(``mean_scores``, the largest |score - fp32 score| of each row: a float, or per row).
    With a low ``precision`` the GEMM's operands are in its dtype: bf16 (within screen.margin
    of fp32, ~3x fp32's rate on 1 thread of a CPU with AVX512-BF16), or int8 (the rows each
    with its scale, the means with one: exact int32 sums, ~1.6x bf16's rate with the rows'
    quantization, each row's error bounded as q8.py's screen bounds it). Routing decides only
    where to search, never a score, and ``_route`` widens m_out by the error."""
    if precision == "int8":
        sums, scale, bias, err = _int8_routing(lay, x)
        return _scores(sums, scale, bias), err
    bias = _bias(lay, x.device)
    dtype = gemm_dtype(precision)
    means = lay.cached("means", x.device, precision, lambda: lay.means, dtype)
    if dtype == torch.float32:
        return torch.addmm(bias, x, means.T), 0.0
    screen.fp32_sums(x)       # routing may run before the screen's first cast (screen.low)
    # the bias in fp32: only the GEMM's rounding is the margin's
    return (x.to(dtype) @ means.T).float().add_(bias), screen.margin(precision, x.shape[1])


def _bias(lay: Layout, device) -> torch.Tensor:
    return lay.cached("bias", device, "fp32", lambda: np.where(
        np.diff(lay.bounds) == 0, -np.inf, ROUTE_SPREAD * spread(lay)).astype(np.float32))


def _int8_routing(lay: Layout, x: torch.Tensor, q: Optional[q8.Q8] = None) -> tuple:
    """int8 routing's parts: (int32 sums [n, C], each row's fp32 scale, the bias, the error
    bound); the scores are fp32(sums) * scale + bias (``_scores``). q: x's rows already
    quantized (q8.rows(x): each row's own, so any slice of them is the slice's)."""
    q, c = q8.rows(x) if q is None else q, lay.low_means(x.device)
    scale = torch.as_tensor(q.scale * c.scale[0], dtype=torch.float32, device=x.device)
    return (q8.int_mm(q.values, c.values), scale, _bias(lay, x.device),
            q8.bound(q.err, q.norm, c.err[0], c.norm[0], x.shape[1]))


def int8_top(lay: Layout, x: torch.Tensor, probe: int, own: Optional[np.ndarray] = None,
             reach: Optional[torch.Tensor] = None, q: Optional[q8.Q8] = None) -> tuple:
    """(native.top_columns' answer on int8 routing scores, the rows' error bound): each row's
    probe best clusters, own[i] first when given (+inf; None: the one-space layouts'), and
    with reach the best score + reach over the others. The scores are formed and selected row
    by row in C from the GEMM's sums (no [n, C] float copy), else in torch: the same answer.
    q: x's rows already quantized (``_int8_routing``)."""
    sums, scale, bias, err = _int8_routing(lay, x, q)
    got = native.route_columns(sums, scale, bias, own, probe, reach)
    if got is None:
        got = native.top_columns(_first(_scores(sums, scale, bias), own), probe, reach)
    return got, err


def _first(m: torch.Tensor, own: Optional[np.ndarray]) -> torch.Tensor:
    """Scores m with +inf at each row's own column (None: m as it is)."""
    if own is None:
        return m
    return m.scatter_(1, torch.as_tensor(own, device=m.device)[:, None], math.inf)


def _scores(sums: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # exact while |sums| < 127^2 d < 2^24 (d <= 1040); beyond, within the bound's d 2^-23
    return sums.float().mul_(scale[:, None]).add_(bias)


class Best:
    """Each row's best k scored pairs (row r, global row j, score s), on a device, from pairs
    that arrive in any number of pieces: what is held is cut to each row's best k only when
    over ~2 n k pairs, and at the end (``lists``). One stable sort of what is held, instead of
    a merge per piece, and the same top-k: best score first, equal scores by the lower global
    row (exact HPM's tie rule, whichever rows are mined together or on which device)."""

    def __init__(self, n: int, k: int, device) -> None:
        self.n, self.k, self.device = n, k, device
        self.parts: list = []
        self.held = 0

    def add(self, r: torch.Tensor, j: torch.Tensor, s: torch.Tensor) -> None:
        self.parts.append((r, j, s))
        self.held += len(r)
        if self.held > 2 * self.n * self.k + COMPACT_SLACK:
            self.parts = [self.lists()]
            self.held = len(self.parts[0][0])

    def lists(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(r, j, s) of each row's best k, by row, then score descending, then j ascending."""
        if not self.parts:
            z = torch.zeros(0, dtype=torch.long, device=self.device)
            return z, z, torch.zeros(0, device=self.device)
        r, j, s = (torch.cat(x) for x in zip(*self.parts))
        o = _row_order(r, j, s)
        r, j, s = r[o], j[o], s[o]
        keep = _slot(r) < self.k
        return r[keep], j[keep], s[keep]

    def unsorted(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(r, j, s) of what is held, unsorted (at most ~2 n k + COMPACT_SLACK entries, every
        row's best k among them): for a Best that merges them (gather's), which sorts once
        with the same result as sorting here first."""
        if not self.parts or self.held > 2 * self.n * self.k:
            return self.lists()          # over twice n k (COMPACT_SLACK's share): cut first
        if len(self.parts) > 1:
            self.parts = [tuple(torch.cat(x) for x in zip(*self.parts))]
        return self.parts[0]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, k] global rows (-1 padded) and scores (0 padded), best first (in C on a CPU:
        native.row_best)."""
        if self.parts and self.k > 0:
            got = native.row_best(*(torch.cat(x) for x in zip(*self.parts)), self.n, self.k)
            if got is not None:
                return got
        r, j, s = self.lists()
        idx = torch.full((self.n, self.k), -1, dtype=torch.long, device=self.device)
        score = torch.zeros((self.n, self.k), device=self.device)
        slot = _slot(r)
        idx[r, slot], score[r, slot] = j, s
        return idx, score


def _row_order(r: torch.Tensor, j: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The order by row, then score descending, then j ascending: stable sorts by j, then by
    one key of row and score (scores > 0: their float bits ascend with them), ~2/3 of three
    sorts' time; three sorts where a score is not positive."""
    o = torch.sort(j, stable=True).indices
    if s.dtype != torch.float32 or not bool((s > 0).all()):
        o = o[torch.sort(s[o], descending=True, stable=True).indices]
        return o[torch.sort(r[o], stable=True).indices]
    key = (r[o].long() << 31) | ((1 << 31) - 1 - s[o].view(torch.int32).long())
    return o[torch.sort(key, stable=True).indices]


def _slot(r: torch.Tensor) -> torch.Tensor:
    """Each entry's place within its row's run (r sorted)."""
    return torch.arange(len(r), device=r.device) - torch.searchsorted(r, r)


DENSE_CELLS = 1 << 22   # at_or_above_kth's dense piece: at most this many values (16 MB)


def at_or_above_kth(r: torch.Tensor, v: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the entries whose value v is at least their row's k-th largest (every entry of a
    row with at most k; r sorted). No entry outside it can be among its row's best k, whatever
    the tie rule, so cutting to it first is exact: a dense [rows, longest run] top-k, ~20x
    cheaper than sorting a dense block's pairs (the demo's random encoders: ~6,000 per row)."""
    _, row, count = torch.unique_consecutive(r, return_inverse=True, return_counts=True)
    keep = torch.ones(len(r), dtype=torch.bool, device=r.device)
    if not len(r) or int(count.max()) <= k:
        return keep
    start = torch.cumsum(count, 0) - count
    v = torch.nan_to_num(v.float(), nan=-math.inf)
    big = (count > k).nonzero().flatten()          # only rows over k need a k-th value
    width = int(count.max())
    step = max(1, DENSE_CELLS // width)            # rows per dense piece: memory bounded
    for a in range(0, len(big), step):
        rows = big[a:a + step]
        at = torch.repeat_interleave(start[rows], count[rows])
        at += torch.arange(len(at), device=r.device) - torch.repeat_interleave(
            torch.cumsum(count[rows], 0) - count[rows], count[rows])
        piece = torch.repeat_interleave(torch.arange(len(rows), device=r.device), count[rows])
        dense = torch.full((len(rows), width), -math.inf, device=r.device)
        dense[piece, at - start[rows][piece]] = v[at]
        keep[at] = v[at] >= dense.topk(k, dim=1).values[:, -1][piece]
    return keep


@dataclass
class UnitResult:
    at: np.ndarray            # [q] each query's index into its chunk's targets (Queries.pos)
    top: tuple                # (r, j, s) on the unit's device, unsorted: pairs with s > 0 of
                              # each query (index into at) among them its best k, j the
                              # global row (Best.unsorted)
    support: np.ndarray       # [q] pairs with s > 0 within the unit
    pairs: dict = field(default_factory=dict)   # PAIR_FIELDS: q (as at), j (global rows), and
                                                # similarities
    cut: np.ndarray = None    # [q] pairs the per-row cap left out already (within the unit)


class Vectors:
    """The sorted vectors a unit reads: arrays or memmaps [N, d] in layout order; ``low``, with
    hpm.precision bf16, their bf16 copies (screen.py: int16 bits on disk, or device tensors)
    by name, which the screen otherwise casts block by block; int8: q8.Copy's."""

    def __init__(self, img, txt, ximg=None, xtxt=None, low: Optional[dict] = None) -> None:
        self.img, self.txt, self.ximg, self.xtxt = img, txt, ximg, xtxt
        self.low = low

    @property
    def cross(self) -> bool:
        return self.ximg is not None


def run_unit(lay: Layout, vec: Vectors, qc: "Queries", c: int, qs: np.ndarray, p: PassParams,
             device: str = "cpu") -> UnitResult:
    """Cluster c: the queries routed to it (``qs``, sorted positions, gathered query_block at a
    time) against its members (a contiguous slice, block_size at a time)."""
    parts = [_query_block(lay, vec, qc, qs[a:a + p.query_block], c, p, device)
             for a in range(0, len(qs), p.query_block)]
    if not parts:
        return empty_result(p.k, device)
    pairs = {f: np.concatenate([x.pairs[f] for x in parts]) for f in parts[0].pairs}
    at, support, cut = (np.concatenate([getattr(x, f) for x in parts])
                        for f in ("at", "support", "cut"))
    first = np.cumsum([0] + [len(x.at) for x in parts])     # a block's r is within the block
    top = tuple(torch.cat(x) for x in zip(*((r + f, j, s) for (r, j, s), f in
                                            zip((x.top for x in parts), first))))
    return UnitResult(at, top, support, pairs, cut)


# a unit (or a query_block piece of one) of at most this many pairs is stacked with others
# (run_stack). 2^20, not 2^18: on 1 thread, 32,768 targets of the 1M synthetic set, interleaved,
# 242-247 against 268-271 us per target (2^23: 245), the same bytes
STACK_PAIRS = 1 << 20


def stacks(lay: Layout, units: list, p: PassParams) -> list:
    """The units as work: each unit's queries in pieces of at most query_block (as run_unit
    splits them); a piece of up to STACK_PAIRS pairs (a GEMM cheaper than a unit's own
    overhead) joins others in a stack of at most query_block x block_size pairs; the others, and
    units of clusters over block_size rows, run alone. Returns (clusters, queries) per piece of
    work: ([c], qs) alone, or (clusters, [qs per cluster]) stacked."""
    size = lambda c: int(lay.bounds[c + 1] - lay.bounds[c])       # noqa: E731
    out = [([c], qs) for c, qs in units if size(c) > p.block_size]
    pieces = [(c, qs[a:a + p.query_block]) for c, qs in units if size(c) <= p.block_size
              for a in range(0, len(qs), p.query_block)]
    small = [(c, qs) for c, qs in pieces if size(c) * len(qs) <= STACK_PAIRS]
    out += [([c], qs) for c, qs in pieces if size(c) * len(qs) > STACK_PAIRS]
    group: list = []
    held = 0
    for c, qs in small:
        if group and held + size(c) * len(qs) > p.query_block * p.block_size:
            out.append(_piece(group))
            group, held = [], 0
        group.append((c, qs))
        held += size(c) * len(qs)
    return out + ([_piece(group)] if group else [])


def _piece(group: list) -> tuple:
    return ([group[0][0]], group[0][1]) if len(group) == 1 else \
        ([c for c, _ in group], [qs for _, qs in group])


def run_stack(lay: Layout, vec: Vectors, qc: "Queries", cs: list, qss: list, p: PassParams,
              device: str = "cpu") -> UnitResult:
    """Several units at once (``stacks``): each unit's GEMMs (the same as alone: its queries x
    its cluster's contiguous members) write into one flat buffer, and one candidate pass runs
    over all of it (screen.ragged_pairs). A unit alone costs ~30 small operations besides its
    GEMMs: with clusters of a few hundred rows, or few queries per unit, those would bound the
    pass. Row i of the result is the i-th query of the units' queries concatenated."""
    a = np.array([lay.bounds[c] for c in cs], np.int64)
    size = np.array([lay.bounds[c + 1] for c in cs], np.int64) - a
    qoff = np.cumsum([0] + [len(x) for x in qss])
    qall = np.concatenate(qss)
    q = qc.rows(qall)
    blocks = [(int(qoff[u]), int(qoff[u + 1]),
               {x: None if not q.has(x) else _rows(getattr(vec, x), a[u], a[u] + size[u], device)
                for x in NAMES},
               vec.low and {x: screen.low_rows(vec.low[x], slice(a[u], a[u] + size[u]), device,
                                               cs[u]) for x in vec.low}) for u in range(len(cs))]
    at = screen.offsets(blocks)
    unit = np.repeat(np.arange(len(cs)), np.diff(qoff))        # each query's unit
    col = qall - a[unit]                       # a query's own row, if in its unit's cluster
    mine_ = np.flatnonzero((col >= 0) & (col < size[unit]))
    own = at[unit[mine_]] + (mine_ - qoff[unit[mine_]]) * size[unit[mine_]] + col[mine_]
    base = None if p.precision == "fp32" else \
        {x: _whole(getattr(vec, x)) for x in NAMES if q.has(x)}      # the re-score's
    r, member, val = screen.ragged_pairs(q, blocks, p.floors(), p.tau_i, p.tau_t, p.precision,
                                         torch.as_tensor(own, device=device), (base, a))
    acc = Findings(len(qall), p, device)
    acc.add(r, lay.order_on(device)[member], val)
    return acc.result(q.index.cpu().numpy())


def empty_result(k: int, device="cpu") -> UnitResult:
    z = np.zeros(0, np.int64)
    return UnitResult(z, Best(0, k, device).lists(), z, no_pairs(), z)


def no_pairs() -> dict:
    return {f: np.zeros(0, np.int64 if f in "qj" else np.float32) for f in PAIR_FIELDS}


def _take(x, pos: np.ndarray, device: str) -> Optional[torch.Tensor]:
    return None if x is None else as_tensor(x[pos], device)


class Queries:
    """A chunk's targets, gathered once from the N-row vectors and cast once to the screen's
    precision: a target is a query of ``probe`` units, which take its rows from here (a
    compact chunk x D copy) instead of gathering and casting them again from N rows."""

    def __init__(self, vec: Vectors, pos: np.ndarray, precision: str, device) -> None:
        self.pos, self.target = np.unique(pos, return_index=True)   # target: pos's index
        self.device = device
        self.full = {x: _take(getattr(vec, x), self.pos, device) for x in NAMES}
        self.low = screen.low(self.full, precision)

    def full_rows(self, qpos: np.ndarray, name: str) -> torch.Tensor:
        """The fp32 vectors ``name`` of the queries at sorted positions qpos."""
        i = torch.as_tensor(np.searchsorted(self.pos, qpos), device=self.device)
        return self.full[name].index_select(0, i)

    def rows(self, qpos: np.ndarray) -> screen.QueryRows:
        """The vectors of the queries at sorted positions qpos (low ones gathered, fp32 ones
        where needed: screen.QueryRows)."""
        i = torch.as_tensor(np.searchsorted(self.pos, qpos), device=self.device)
        if self.low is self.full:
            return screen.QueryRows(self.full, i)
        return screen.QueryRows(self.full, i, {x: None if v is None else v.index_select(0, i)
                                               for x, v in self.low.items()})


def _query_block(lay, vec: Vectors, qc: Queries, qpos_np: np.ndarray, c: int, p: PassParams,
                 device) -> UnitResult:
    q, floors = qc.rows(qpos_np), p.floors()
    qpos = torch.as_tensor(qpos_np, device=device)
    acc, to_row = Findings(len(qpos_np), p, device), lay.order_on(device)
    a, b = int(lay.bounds[c]), int(lay.bounds[c + 1])
    for s0 in range(a, b, p.block_size):
        s1 = min(b, s0 + p.block_size)
        m = {x: None if not q.has(x) else _rows(getattr(vec, x), s0, s1, device) for x in NAMES}
        m_low = vec.low and {x: screen.low_rows(vec.low[x], slice(s0, s1), device, c)
                             for x in vec.low}
        own = ((qpos >= s0) & (qpos < s1)).nonzero().flatten()
        r, cc, val = screen.block_pairs(q, m, m_low, floors, p.tau_i, p.tau_t,
                                        p.precision, own, qpos[own] - s0)
        acc.add(r, to_row[cc + s0], val)
    return acc.result(q.index.cpu().numpy())


class Findings:
    """What n query rows found, as member blocks arrive: the top-k (Best), support, and the
    pairs above the floors, capped per row once over ~2 n max_pairs (a row's best max_pairs
    overall are among its best so far and the new ones: exact, as in gather), so it holds
    ~2 n max_pairs pairs (+ COMPACT_SLACK), whatever the cluster's size."""

    def __init__(self, n: int, p: PassParams, device) -> None:
        self.p, self.device, self.floors = p, device, p.floors()
        self.best = Best(n, p.k, device)
        self.support = torch.zeros(n, dtype=torch.long, device=device)
        self.found: list = []          # pairs as device tensors, until capped
        self.held, self.cut = 0, np.zeros(n, np.int64)

    def add(self, r: torch.Tensor, member: torch.Tensor, val: dict) -> None:
        """A block's candidate pairs: rows r, members' global rows, exact similarities."""
        p = self.p
        new = _above_floors(val, self.floors, r, member, p.max_pairs, self.cut)
        self.found, self.held = self.found + new, self.held + sum(len(x[0]) for x in new)
        if p.max_pairs is not None and self.held > 2 * len(self.cut) * p.max_pairs + COMPACT_SLACK:
            capped = _cap(_pairs(self.found), p.max_pairs, self.cut)
            self.found, self.held = [_on(capped, self.device)], len(capped["q"])
        ok, v = positive_scores(val["sii"], val["stt"], p.tau_i, p.tau_t, p.dup)
        self.support += torch.bincount(r[ok], minlength=len(self.support))
        r, member, v = r[ok], member[ok], v[ok]
        top = at_or_above_kth(r, v, p.k)
        self.best.add(r[top], member[top], v[top])

    def result(self, at: np.ndarray) -> UnitResult:
        """The rows' results, row i being the chunk's target at[i] (Queries.pos)."""
        pairs = _cap(_pairs(self.found), self.p.max_pairs, self.cut)
        pairs["q"] = at[pairs["q"]]
        return UnitResult(at, self.best.unsorted(), self.support.cpu().numpy(), pairs, self.cut)


def _above_floors(val: dict, floors: dict, r: torch.Tensor, j: torch.Tensor,
                  max_pairs: Optional[int] = None, cut: Optional[np.ndarray] = None) -> list:
    """The listed pairs (query r, member j) above a floor, with every similarity (NaN for the
    cross-modal ones when there are none); with max_pairs, only those at or above their row's
    max_pairs-th largest max similarity (``_cap``'s order: exact), the others counted in cut.
    The pairs are taken by index once (a boolean mask per similarity cost ~2x in the dense
    case)."""
    keep = torch.zeros(len(r), dtype=torch.bool, device=r.device)
    for name, floor in floors.items():
        if name in val:
            keep |= val[name] > floor
    at = keep.nonzero().flatten()
    if not len(at):
        return []
    sims, r = {f: val[f][at] for f in SIMS if f in val}, r[at]
    if max_pairs is not None:
        best = torch.stack(list(sims.values())).nan_to_num(-math.inf).max(0).values
        top = at_or_above_kth(r, best, max_pairs)
        if not bool(top.all()):
            cut += np.bincount(r[~top].cpu().numpy(), minlength=len(cut))
            at, r, sims = at[top], r[top], {f: v[top] for f, v in sims.items()}
    nan = torch.full((len(at),), math.nan, device=r.device)
    return [(r, j[at], *(sims.get(f, nan) for f in SIMS))]


def canonical(j: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row best first, equal scores by ascending global row (padding last): the order does
    not depend on the layout, the units or the block shapes. Returns (rows, permutation)."""
    key = np.where(j >= 0, j, np.iinfo(np.int64).max)
    perm = np.lexsort((key, -s), axis=1) if len(j) else np.zeros(j.shape, np.int64)
    return np.take_along_axis(j, perm, 1), perm


def _on(pairs: dict, device) -> tuple:
    """Capped pairs back to the device tuples they were found as."""
    return tuple(torch.as_tensor(pairs[f], device=device) for f in PAIR_FIELDS)


def _pairs(found) -> dict:
    """A query block's pairs (device tuples: q, j, SIMS), moved to the host once: q its query
    (within the block), j the member's global row."""
    if not found:
        return no_pairs()
    r, j, *sims = (torch.cat(x).cpu().numpy() for x in zip(*found))
    return {"q": r.astype(np.int64), "j": j.astype(np.int64),
            **{f: x.astype(np.float32) for f, x in zip(SIMS, sims)}}


# --- mining rows ---------------------------------------------------------------------------------
@dataclass
class Found:
    """What the pass found for a set of rows, in their order: top-k, support, certificate, and
    the pairs in CSR form (row i's pairs are pair_*[offsets[i]:offsets[i+1]], sorted by j)."""
    idx: np.ndarray
    score: np.ndarray
    support: np.ndarray
    certified: np.ndarray
    offsets: np.ndarray
    pair_j: np.ndarray
    pair_sii: np.ndarray
    pair_stt: np.ndarray
    pair_sit: np.ndarray       # NaN without cross-modal vectors, as are:
    pair_xii: np.ndarray
    pair_xtt: np.ndarray


@dataclass
class PassResult(Found):
    """Found, plus ``bound``: the largest score a pair outside the searched clusters can have;
    ``cut``: each row's pairs left out by the per-row cap; ``scored``: (query, member) pairs
    scored, for FLOP counts; ``widened``, ``everywhere``: rows ``complete`` searched again,
    and of them those searched in every cluster."""
    bound: np.ndarray
    cut: np.ndarray
    scored: int = 0
    widened: int = 0
    everywhere: int = 0

    @property
    def noise(self) -> np.ndarray:
        return self.support < self.idx.shape[1]

    def certified_at(self, k: int) -> np.ndarray:
        """The certificate for the top-k prefix (k <= the pass's k)."""
        return (self.bound <= 0) | ((self.support >= k) & (self.score[:, k - 1] >= self.bound))

    @staticmethod
    def concat(parts: list["PassResult"]) -> "PassResult":
        base = np.cumsum([0] + [len(x.pair_j) for x in parts])
        offsets = np.concatenate([[0]] + [x.offsets[1:] + b for x, b in zip(parts, base)])
        cat = {f.name: np.concatenate([getattr(x, f.name) for x in parts])
               for f in dataclasses.fields(PassResult) if f.name not in ("offsets", *COUNTS)}
        return PassResult(**cat, offsets=offsets,
                          **{f: sum(getattr(x, f) for x in parts) for f in COUNTS})


COUNTS = ("scored", "widened", "everywhere")     # PassResult's counts: summed by concat


def mine(lay: Layout, vec: Vectors, pos: np.ndarray, p: PassParams, device: str = "cpu",
         routed: Optional[tuple] = None) -> PassResult:
    """The rows at sorted positions ``pos`` (results in that order): route each to its ``probe``
    clusters (or take ``routed``, ``route``'s answer), group the queries by cluster (units, in
    cluster order, queries by position), run the units (small ones stacked) and merge. A row's
    result depends only on the layout and its own routing, never on the other rows mined with
    it; memory is bounded by len(pos), not N."""
    return mine_routed(lay, vec, pos, p, device, routed)[0]


def mine_routed(lay: Layout, vec: Vectors, pos: np.ndarray, p: PassParams, device: str = "cpu",
                routed: Optional[tuple] = None) -> tuple[PassResult, np.ndarray]:
    """``mine``, and each row's routes (spaces.py's add_pairs reads them), the support of rows
    found short completed (``complete``, with p.exact_noise)."""
    pos = np.asarray(pos, np.int64)
    with freed_memory_kept():
        r, routes = _mine(lay, vec, pos, p, device, routed)
        if p.exact_noise:
            complete(lay, vec, pos, r, routes, p, device)
        return r, routes


def _mine(lay: Layout, vec: Vectors, pos: np.ndarray, p: PassParams, device: str,
          routed: Optional[tuple]) -> tuple[PassResult, np.ndarray]:
    qc = Queries(vec, pos, p.precision, device)
    routes, m_out = routed or route(lay, vec, pos, p.probe, device, p.precision, qc)
    srt = np.argsort(pos, kind="stable")       # queries ascending, so by cluster alone
    q = np.repeat(pos[srt], routes.shape[1])
    c = routes[srt].ravel()
    if routes.size and routes.min() < 0:          # complete's routes: -1 = none
        q, c = q[c >= 0], c[c >= 0]
    o = by_cluster(c, lay.n_clusters)
    q, c = q[o], c[o]
    cuts = np.searchsorted(c, np.arange(lay.n_clusters + 1))
    units = [(u, q[cuts[u]:cuts[u + 1]]) for u in range(lay.n_clusters) if cuts[u + 1] > cuts[u]]
    with torch.no_grad():
        results = (run_unit(lay, vec, qc, u[0], qs, p, device) if len(u) == 1 else
                   run_stack(lay, vec, qc, u, qs, p, device) for u, qs in stacks(lay, units, p))
        r = gather(qc.target, p, results, m_out, device)
    r.scored = int(sum(len(qs) * (lay.bounds[u + 1] - lay.bounds[u]) for u, qs in units))
    return r, routes


# complete: a short row's probe widens this many times first, then to every cluster
WIDEN = 4
WIDE_CELLS = 1 << 22      # rows x clusters routed at a time by the last step


def complete(lay: Layout, vec: Vectors, pos: np.ndarray, r: PassResult, routes: np.ndarray,
             p: PassParams, device: str = "cpu") -> None:
    """HELIP's noise rule decides on a count, which a partial search undercounts: rows with
    fewer than k supporters found and a bound > 0 (a pair left out could support them) are
    searched again in the clusters they did not search, first WIDEN x probe of them (the next
    by routing: most rows near the threshold reach k there), then, for those still short, every
    other cluster. Their support is then exact (clusters are disjoint: counts add), so is
    their noise decision, and after the last step their top-k and certificate too. In place on
    ``r``; only the top-k, support, bound and certificate of those rows change (their
    candidate pairs are the pass's: the searches keep none)."""
    short = np.flatnonzero((r.support < p.k) & (r.bound > 0))
    if not len(short):
        return
    q = dataclasses.replace(p, floor_i=2.0, floor_t=2.0, floor_x=2.0)
    r.widened += len(short)
    searched = np.zeros((len(short), lay.n_clusters), bool)
    np.put_along_axis(searched, routes[short], True, 1)
    wide = min(WIDEN * p.probe, lay.n_clusters)
    if wide > routes.shape[1]:
        top, m_out = route(lay, vec, pos[short], wide, device, p.precision)
        _search(lay, vec, pos, r, short, np.where(
            np.take_along_axis(searched, top, 1), -1, top), m_out, q, device)
        np.put_along_axis(searched, top, True, 1)
        still = (r.support[short] < p.k) & (r.bound[short] > 0)
        short, searched = short[still], searched[still]
    r.everywhere += len(short)
    step = max(1, WIDE_CELLS // lay.n_clusters)
    every = np.arange(lay.n_clusters)[None, :]
    empty = np.diff(lay.bounds) == 0
    for a in range(0, len(short), step):
        rest = np.where(searched[a:a + step] | empty, -1, every)
        _search(lay, vec, pos, r, short[a:a + step], rest,
                np.full(len(rest), -np.inf, np.float32), q, device)


def _search(lay: Layout, vec: Vectors, pos: np.ndarray, r: PassResult, rows: np.ndarray,
            routes: np.ndarray, m_out: np.ndarray, p: PassParams, device: str) -> None:
    """``complete``'s step: r's ``rows`` searched again in the clusters ``routes`` (-1: none;
    m_out bounds every other cluster not searched yet): support added, top-k merged (Best's
    order), bound and certificate renewed."""
    got, _ = _mine(lay, vec, pos[rows], p, device, (routes, m_out))
    r.support[rows] += got.support
    best = Best(len(rows), p.k, "cpu")
    for idx, score in ((r.idx[rows], r.score[rows]), (got.idx, got.score)):
        at, slot = np.nonzero(idx >= 0)
        best.add(*(torch.as_tensor(x) for x in (at, idx[at, slot], score[at, slot])))
    idx, score = (x.numpy() for x in best.dense())
    r.idx[rows], r.score[rows] = idx, score
    r.bound[rows] = np.minimum(r.bound[rows], got.bound)
    r.certified[rows] = (r.bound[rows] <= 0) | ((r.support[rows] >= p.k) &
                                                (score[:, p.k - 1] >= r.bound[rows]))
    r.scored += got.scored


def by_cluster(c: np.ndarray, n_clusters: int) -> np.ndarray:
    """The stable order of entries by their cluster c (mine's entries come by ascending query,
    so they end by cluster, then query): a counting sort in C (native), or NumPy's radix sort
    for clusters that fit in 16 bits (~1/4 of lexsort's time for 2M entries)."""
    got = native.stable_order(c, n_clusters)
    if got is not None:
        return got
    return np.argsort(c.astype(np.uint16) if n_clusters <= 1 << 16 else c, kind="stable")


def gather(target: np.ndarray, p: PassParams, results: Iterable[UnitResult], m_out: np.ndarray,
           device: str = "cpu") -> PassResult:
    """Merge the units' partial top-k of n = len(m_out) targets (each searched by ``probe``
    units; the top-k merged on ``device``), sum their support, cap their pairs at
    p.max_pairs, and certify with m_out (the bound on a left-out row's joint similarity, per
    target). ``target``: the target of each Queries row (UnitResult.at), by index."""
    n, k = len(m_out), p.k
    best = Best(n, k, device)
    support = np.zeros(n, np.int64)
    cut = np.zeros(n, np.int64)
    pairs = Held(n, p.max_pairs, cut)
    for r in results:
        at = target[r.at]
        np.add.at(cut, at, r.cut)
        best.add(torch.as_tensor(at, device=device)[r.top[0]], *r.top[1:])
        np.add.at(support, at, r.support)         # a stack may list a row more than once
        pairs.add(dict(r.pairs, q=target[r.pairs["q"]]))
    # already canonical's order (Best's: best first, equal scores by ascending global row; it
    # holds scores > 0 only, so the padding is last), whatever the layout, units or blocks
    idx, score = (x.cpu().numpy() for x in best.dense())
    bound = score_bound(torch.from_numpy(m_out).clamp(max=1.0), p.tau_i, p.tau_t).numpy()
    cert = (bound <= 0) | ((support >= k) & (score[:, k - 1] >= bound))
    offsets, pj, sims = csr(pairs.pairs(), n)
    return PassResult(idx, score, support, cert, offsets, pj, *sims, bound, cut)


def csr(cat: dict, n: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Pairs (q in 0..n-1) as CSR, each row's sorted by j: (offsets, j, [each of SIMS])."""
    o = np.lexsort((cat["j"], cat["q"]))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(cat["q"], minlength=n), out=offsets[1:])
    return offsets, cat["j"][o], [cat[f][o] for f in SIMS]


COMPACT_SLACK = 1 << 20    # pairs held beyond 2 x n x max_pairs before gather caps them


class Held:
    """Pairs of n rows as they arrive (gather's units, spaces.py's searches), capped at
    max_pairs per row once over ~2 n max_pairs: exact, as a row's best max_pairs of all its
    pairs are the best of its best so far and the new ones; what the cap leaves out is
    counted in ``cut``. After a cap, a row holding max_pairs pairs has a floor (its worst
    kept max similarity): a new pair strictly below it can never be kept, so it is counted
    and dropped on arrival (ties are kept: the cap orders them by j). Without it a chunk of
    dense rows (every pair above the floors) sorted its millions of pairs again and again."""

    def __init__(self, n: int, max_pairs, cut: np.ndarray) -> None:
        self.n, self.max_pairs, self.cut = n, max_pairs, cut
        self.held, self.count = [], 0
        self.floor = np.full(n, -np.inf, np.float32)

    def add(self, pairs: dict) -> None:
        if self.max_pairs is not None and len(pairs["q"]):
            low = _best(pairs) < self.floor[pairs["q"]]
            if low.any():
                np.add.at(self.cut, pairs["q"][low], 1)
                pairs = {f: v[~low] for f, v in pairs.items()}
        self.held.append(pairs)
        self.count += len(pairs["q"])
        if self.max_pairs is not None and \
                self.count > 2 * self.n * self.max_pairs + COMPACT_SLACK:
            self.held = [self.pairs()]
            self.count = len(self.held[0]["q"])
            self.floor = _floors(self.held[0], self.n, self.max_pairs)

    def pairs(self) -> dict:
        return _cap(_concat(self.held), self.max_pairs, self.cut)


def _best(pairs: dict) -> np.ndarray:
    """Each pair's max(S_ii, S_tt, S_it, X_ii, X_tt): the order of ``_cap``."""
    return np.fmax.reduce([pairs[f] for f in SIMS])


def _floors(capped: dict, n: int, max_pairs: int) -> np.ndarray:
    """Per row, its worst kept pair's _best where it holds max_pairs pairs, else -inf."""
    q, best = capped["q"], _best(capped)
    low = np.full(n, np.inf, np.float32)
    np.minimum.at(low, q, best)
    return np.where(np.bincount(q, minlength=n) >= max_pairs, low, -np.inf).astype(np.float32)


def _concat(pairs: list[dict]) -> dict:
    return {f: np.concatenate([x[f] for x in pairs]) if pairs else no_pairs()[f]
            for f in PAIR_FIELDS}


def _cap(cat: dict, max_pairs: Optional[int], cut: Optional[np.ndarray] = None) -> dict:
    """At most max_pairs pairs per row q, highest max(S_ii, S_tt, S_it, X_ii, X_tt) first (one
    scale for every space: in cross mode HELIP's S_ii ~0.9 outranks an S_it ~0.3), equal ones
    by j; what it leaves out is counted per row in ``cut``. Only the rows over the cap are
    sorted, after ``at_or_above_kth`` dropped what cannot make their best max_pairs (in the
    demo's dense case, every pair above the floors, a full sort of each unit's pairs was ~40%
    of the pass). The pairs come back in no set order (``csr`` sorts them)."""
    if max_pairs is None or not len(cat["q"]):
        return cat
    full = np.bincount(cat["q"]) > max_pairs
    if not full.any():
        return cat
    rest = np.flatnonzero(~full[cat["q"]])                  # rows under the cap: all kept
    at = np.flatnonzero(full[cat["q"]])
    at = at[np.argsort(cat["q"][at], kind="stable")]          # at_or_above_kth wants q sorted
    best = _best({f: cat[f][at] for f in SIMS})
    top = at_or_above_kth(torch.from_numpy(cat["q"][at]), torch.from_numpy(best),
                          max_pairs).numpy()
    if cut is not None:
        np.add.at(cut, cat["q"][at[~top]], 1)
    at, best = at[top], best[top]
    q = cat["q"][at]
    o = np.lexsort((cat["j"][at], -best, q))
    over = np.arange(len(o)) - np.searchsorted(q[o], q[o]) >= max_pairs
    if cut is not None:
        np.add.at(cut, q[o][over], 1)
    return {f: v[np.concatenate([rest, at[o[~over]]])] for f, v in cat.items()}


def sorted_vectors(lay: Layout, img, txt, ximg=None, xtxt=None, precision: str = "fp32"
                   ) -> Vectors:
    """In-memory copies in layout order, with their ``precision`` copies as the stage stores
    them (tests, the benchmark; the stage memory-maps them: save_vectors)."""
    out = [None if x is None else take_rows(x, lay.order) for x in (img, txt, ximg, xtxt)]
    low = {n: low_copy(x, lay, precision) for n, x in zip(NAMES, out)
           if x is not None and precision != "fp32"}
    return Vectors(*out, low=low or None)


def take_rows(x, rows: np.ndarray) -> np.ndarray:
    """x[rows] as a float32 array: by torch's index_select where x is float32 and contiguous
    (an array or a memmap, shared: ~4x NumPy's fancy indexing of 1.5 KB rows, 1.0 against
    3.9 s for 1M rows), else NumPy's."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous:
        return as_tensor(x, "cpu").index_select(0, torch.as_tensor(rows)).numpy()
    return np.ascontiguousarray(np.asarray(x)[rows], np.float32)


def low_copy(x: np.ndarray, lay: Layout, precision: str):
    """Sorted rows' copy in a low ``precision``: bf16 bits, or a q8.Copy (per-cluster scales)."""
    if precision != "int8":
        return screen.to_bits(x, precision)
    parts = [q8.cluster_copy(x[a:b], lay.cluster_of(np.arange(a, b)), lay.n_clusters)
             for a, b in _cluster_chunks(lay, 65536)]
    return q8.Copy(np.concatenate([v for v, _ in parts] or [np.zeros((0, x.shape[1]), np.int8)]),
                   sum(st for _, st in parts) if parts else np.zeros((lay.n_clusters, 3)))


def neighbour_pass(img, txt, p: PassParams, ximg=None, xtxt=None, device: str = "cpu",
                   max_pairs: Optional[int] = None, rows: int = 4096
                   ) -> tuple[Layout, PassResult]:
    """The whole pass in memory (tests, the benchmark): layout, then every row mined, ``rows``
    at a time, by global row."""
    p = p if max_pairs is None else dataclasses.replace(p, max_pairs=max_pairs)
    lay = build_layout(img, txt, p, device)
    vec = sorted_vectors(lay, img, txt, ximg, xtxt, p.precision)
    pos = lay.positions()
    return lay, PassResult.concat([mine(lay, vec, pos[a:a + rows], p, device)
                                   for a in range(0, max(len(pos), 1), rows)])


# --- sorted vectors on disk ----------------------------------------------------------------------


def save_vectors(dir_: str, lay: Layout, arrays: dict, precision: str = "fp32",
                 chunk: int = 65536) -> None:
    """Write each [N, d] array of ``arrays`` (keys in NAMES) in layout order, float32, and
    with a low ``precision`` its copy in that precision too (screen.to_bits; int8: q8.py, with
    each cluster's scale and bounds in ``<name>.int8.npy``), whole clusters at a time."""
    os.makedirs(dir_, exist_ok=True)
    for name, x in arrays.items():
        if x is None:
            continue
        stats = np.zeros((lay.n_clusters, 3))
        with ExitStack() as stack:
            f32 = stack.enter_context(open(os.path.join(dir_, f"{name}.f32"), "wb"))
            low = None if precision == "fp32" else stack.enter_context(
                open(os.path.join(dir_, f"{name}.{precision}"), "wb"))
            for a, b in _cluster_chunks(lay, chunk):
                rows = lay.order[a:b]
                block = take_rows(take_rows(x, np.sort(rows)), np.argsort(np.argsort(rows)))
                f32.write(block.tobytes())
                if precision == "int8":
                    v, s = q8.cluster_copy(block, lay.cluster_of(np.arange(a, b)), lay.n_clusters)
                    low.write(v.tobytes())
                    stats += s                         # each cluster in one chunk: zeros elsewhere
                elif low is not None:
                    low.write(screen.to_bits(block, precision).tobytes())
        if precision == "int8":
            np.save(os.path.join(dir_, f"{name}.int8.npy"), stats)
        with open(os.path.join(dir_, f"{name}.dim"), "w") as fh:
            fh.write(str(x.shape[1]))


def _cluster_chunks(lay: Layout, chunk: int):
    """(a, b): sorted positions of about ``chunk`` rows, each cut at a cluster's start."""
    n = len(lay.order)
    cuts = np.unique(np.r_[lay.bounds[np.searchsorted(lay.bounds, np.arange(0, n, chunk),
                                                      side="right") - 1], n])
    return zip(cuts[:-1].tolist(), cuts[1:].tolist())


def load_vectors(dir_: str, n: int) -> Vectors:
    out, low = [], {}
    for name in NAMES:
        path = os.path.join(dir_, f"{name}.f32")
        if not os.path.exists(path):
            out.append(None)
            continue
        with open(os.path.join(dir_, f"{name}.dim")) as fh:
            d = int(fh.read())
        out.append(mapped(path, np.float32, (n, d)) if n else np.zeros((0, d), np.float32))
        for precision in screen.LOW:
            path = os.path.join(dir_, f"{name}.{precision}")
            if os.path.exists(path) and n:
                low[name] = mapped(path, np.int16, (n, d))
        path = os.path.join(dir_, f"{name}.int8")
        if os.path.exists(path) and n:
            low[name] = q8.Copy(mapped(path, np.int8, (n, d)), np.load(f"{path}.npy"))
    return Vectors(*out, low=low or None)


def mapped(path: str, dtype, shape: tuple) -> np.ndarray:
    """A file's read-only memory map as a plain ndarray view (the map lives as its base): a
    slice of it costs ~0.3 us, an np.memmap's ~18 (its __getitem__ and __array_finalize__ in
    Python; a unit takes ~4 slices: ~4% of the int8 pass)."""
    return np.asarray(np.memmap(path, dtype, "r", shape=shape))


LAYOUT = ("means", "radius", "order", "bounds")


def save_layout(dir_: str, lay: Layout) -> None:
    os.makedirs(dir_, exist_ok=True)
    for f in LAYOUT:
        np.save(os.path.join(dir_, f"{f}.npy"), getattr(lay, f))
    np.save(os.path.join(dir_, "positions.npy"), lay.positions())


def load_layout(dir_: str) -> tuple[Layout, np.ndarray]:
    """The layout (its order memory-mapped) and the sorted position of each global row."""
    lay = Layout(*(_npy(os.path.join(dir_, f"{f}.npy"), f == "order") for f in LAYOUT))
    return lay, _npy(os.path.join(dir_, "positions.npy"), True)


def _npy(path: str, as_map: bool) -> np.ndarray:
    """A saved array: read whole, or memory-mapped (read-only) as a plain ndarray view
    (``mapped``'s reason: cheap slices)."""
    return np.asarray(np.load(path, mmap_mode="r")) if as_map else np.load(path)
