"""hpm.engine.precision int8: the neighbour pass's blocks screened by int8 GEMMs, with a bound
proven per row instead of bf16's fixed margin, then re-scored in fp32 like bf16's (screen.py).

An int8 GEMM sums exact integer products in int32: on a CPU with AVX512-VNNI (or AMX) it runs at
~2x bf16's rate (1.6-2x for a unit's block on this machine, tests/benchmarks/bench_mining.py),
on a GPU's tensor cores at 2x too. Rows are quantized symmetrically, x ~ s * v with v integer
in [-127, 127]:

* a query with its own scale s_i = max|x_i| / 127;
* a cluster's members with one scale for the cluster (the largest of its rows'), so that a
  block's screen compares every pair of a query row against one integer threshold.

With q~ = s_q v_q and m~ = s_m v_m (exact: the scales are float64 and the sums integers),
e = ||x - x~|| and n = ||x~|| (float64, rounded up by SLACK), Cauchy-Schwarz gives

    |<q~, m~> - <q, m>| <= n_q e_m + e_q n_m + e_q e_m,

with the cluster's largest e_m and n_m; the fp32 re-score is within K 2^-23 of <q, m>. So a
pair is a candidate for threshold t when its integer sum D exceeds

    T_i = floor((t - bound_i) / (s_q s_m)) - 1,

a superset of the pairs whose fp32 similarity exceeds t (tested against fp32 at pairs placed
on the thresholds). The bound follows each row's actual rounding (~0.018 at 384 dimensions
against bf16's fixed 0.012), so a few more pairs are re-scored (~13% more at 1M rows: 87 per
target against 77).
Clusters' scales and bounds are stored beside the int8 copy (``Copy``); blocks quantized on
the fly (no stored copy) take their own. On a CPU with AVX512-VNNI a block's GEMMs and its
compares run fused in C (``fused``, ``hits``: kernels.screen_int8), elsewhere torch's GEMMs,
then the compares: exact integer sums either way, so the same pairs. The one-space searches
screen the same way (``hits``: each space's own int8 copy), the layout's k-means and
assignment use int8 GEMMs without a bound (precision's nearest: they only decide where rows sit),
and routing scores the cluster means in int8 (routing_scores: the means share one
scale; each row's ``bound`` widens the certificate's m_out, as bf16's margin does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..engine.core import cache_rows
from ..engine.screen import where
from ..hpm import as_tensor
from . import kernels

MAX = 127
SLACK = 1e-9         # relative: float64 norms (exact to ~d 2^-53) rounded up by this
GUARD = 1e-6         # absolute, on every bound
INT32 = (-(2 ** 31), 2 ** 31 - 1)


@dataclass
class Q8:
    """Rows x ~ scale * values: values [n, d] int8 (a tensor, on the pass's device); scale, err
    (||x - x~||) and norm (||x~||): float64 NumPy [n] (host: thresholds are computed there),
    or [1] for a member block sharing them (its cluster's largest err and norm)."""
    values: torch.Tensor
    scale: np.ndarray
    err: np.ndarray
    norm: np.ndarray

    def index_select(self, dim: int, i: torch.Tensor) -> "Q8":
        """Rows i (as a tensor's index_select: QueryRows gathers either). On a CPU by NumPy:
        torch's int8 index_select with 2 threads on a loaded machine took ~5.6 ms for 1,000 x
        384 rows, NumPy's 0.03 ms (the same bytes)."""
        at = i.cpu().numpy()
        v = self.values
        rows = torch.from_numpy(v.numpy()[at]) if v.device.type == "cpu" and dim == 0 else \
            v.index_select(dim, i)
        return Q8(rows, *(x[at] for x in self.stats()))

    def __getitem__(self, rows: slice) -> "Q8":
        return Q8(self.values[rows], *(x[rows] for x in self.stats()))

    def stats(self) -> tuple:
        return self.scale, self.err, self.norm

    @property
    def shape(self):
        return self.values.shape

    def __len__(self) -> int:
        return len(self.values)


def quantize(x: torch.Tensor, group: Optional[torch.Tensor] = None, groups: int = 0) -> tuple:
    """float32 rows [n, d] -> (values int8, then scale, err, norm: float64 NumPy [n]); with
    ``group`` (each row's group in 0..groups-1) every row of a group takes the group's scale
    (its largest max|x| / 127). A zero row gets scale 1 (values 0, err 0). The float64 work
    runs core.cache_rows' values at a time on a CPU (each row's results are its own): temporaries
    that stay in cache, ~6x faster than whole (32,768 x 384: 42 against 265 ms)."""
    n, d = x.shape
    top = abs_max(x).double() if d else torch.zeros(n, dtype=torch.float64,
                                                     device=x.device)   # exact in fp32
    if group is not None:
        top = torch.zeros(groups, dtype=torch.float64, device=x.device).scatter_reduce(
            0, group, top, "amax")[group]
    scale = torch.where(top > 0, top / MAX, torch.ones_like(top))
    values = torch.empty((n, d), dtype=torch.int8, device=x.device)
    err, norm = (torch.empty(n, dtype=torch.float64, device=x.device) for _ in range(2))
    step = cache_rows(x)
    for a in range(0, n, step):
        _quantize_rows(x[a:a + step], scale[a:a + step], values[a:a + step], err[a:a + step],
                       norm[a:a + step])
    return (values, *(v.cpu().numpy() for v in (scale, err, norm)))


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """Each row's largest |value| (d >= 1): max(max x, -min x), no |x| copy; exact, so the
    same values as x.abs().amax(1). Two vectorized reductions: ~8x torch.aminmax's speed on
    a CPU (8,192 x 768 on 1 thread: 1.7 against 14 ms; the layout ran ~4 s of aminmax at 1M).
    A NaN row gives NaN, as abs().amax does."""
    return torch.maximum(x.amax(1), x.amin(1).neg_()).abs_()      # -0.0 as 0.0


def _quantize_rows(x: torch.Tensor, scale: torch.Tensor, values: torch.Tensor,
                   err: torch.Tensor, norm: torch.Tensor) -> None:
    """quantize's float64 work for a few rows, into values, err and norm."""
    x64 = x.to(torch.float64, copy=True)
    v = torch.round(x64 / scale[:, None]).clamp_(-MAX, MAX)
    deq = v * scale[:, None]
    up = 1 + SLACK
    torch.mul(deq.norm(dim=1), up, out=norm)
    torch.mul(x64.sub_(deq).norm(dim=1), up, out=err)       # in place: float64 rows
    values.copy_(v)


def rows(x: torch.Tensor) -> Q8:
    """Queries: each row with its own scale."""
    return Q8(*quantize(x))


def block(x: torch.Tensor) -> Q8:
    """A member block quantized as it is read (no stored copy): one scale for the block."""
    return shared(x)


def shared(x: torch.Tensor) -> Q8:
    """Rows with one scale for all (the largest of theirs), and their largest err and norm:
    a block's members, or routing's cluster means."""
    v, s, e, n = quantize(x, torch.zeros(len(x), dtype=torch.long, device=x.device), 1)
    return Q8(v, s[:1], e.max(initial=0)[None], n.max(initial=0)[None])


@dataclass
class Copy:
    """The stored int8 copy of sorted vectors: values [N, d] int8 (a memmap, an array or a
    device tensor) and stats [C, 3] float64 (each cluster's scale, largest err, largest
    norm)."""
    values: object
    stats: np.ndarray

    def block(self, rows: slice, cluster: int, device) -> Q8:
        """Rows of cluster ``cluster`` (a slice within it)."""
        if cluster is None:
            raise ValueError("an int8 block needs its cluster: its scale and bounds are the "
                             "cluster's")
        v = as_tensor(self.values[rows], device, torch.int8)
        return Q8(v, *self.stats[cluster:cluster + 1].T)

    def to(self, device) -> "Copy":
        return Copy(as_tensor(self.values, device, torch.int8), self.stats)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.values.shape))

    def __len__(self) -> int:
        return len(self.values)


def cluster_copy(x: np.ndarray, cluster: np.ndarray, n_clusters: int) -> tuple:
    """Sorted rows x (float32 [n, d]) of clusters ``cluster`` (each row's, ascending; a chunk
    holds whole clusters) -> (values int8 [n, d], stats [n_clusters, 3] of the clusters
    present, zeros elsewhere)."""
    first = int(cluster[0]) if len(cluster) else 0
    g = cluster - first
    k = int(g.max()) + 1 if len(g) else 0
    v, s, e, n = quantize(torch.from_numpy(np.ascontiguousarray(x)), torch.as_tensor(g), k)
    stats = np.zeros((n_clusters, 3))
    stats[cluster, 0] = s
    np.maximum.at(stats[:, 1], cluster, e)
    np.maximum.at(stats[:, 2], cluster, n)
    return v.numpy(), stats


def bound(qe, qn, me, mn, dim: int):
    """The largest |<q~, m~> - fp32 <q, m>| of rows with errs qe, me and norms qn, mn."""
    return qn * me + qe * (mn + me) + (dim * 2.0 ** -23 + GUARD)


def thresholds(q: Q8, spans: list, m: np.ndarray, ts: list) -> list:
    """Per threshold t of ``ts``: the int32 T_i [rows, 1] with D > T_i for every pair whose
    fp32 similarity is above t, for the query rows of every span (a, b) of q one span after
    the other, span u against members with stats m[u] (scale, err, norm). Computed for a
    stack's blocks at once (per block, its few small operations cost ~1/4 of its GEMMs)."""
    if len(spans) == 1:                     # one block (spaces.py's): views, one member row
        qs, qe, qn = (x[slice(*spans[0])] for x in q.stats())
        ms, me, mn = m[0]
    else:
        idx = np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])
        u = np.repeat(np.arange(len(spans)), [b - a for a, b in spans])
        qs, qe, qn = (x[idx] for x in q.stats())
        ms, me, mn = m[u].T
    return [limit(t, qs, qe, qn, ms, me, mn, q.shape[1]).astype(np.int32)[:, None] for t in ts]


def limit(t: float, qs, qe, qn, ms, me, mn, dim: int) -> np.ndarray:
    """The threshold T (float, within int32) of pairs with these stats: D > T for every pair whose
    fp32 similarity is above t. A zero row (scale 0; its similarities are all 0) gets +-inf,
    clipped: no pair where t is above the bound, every pair where it is below, and every pair
    (INT32's least) where they are equal (0 x inf): a superset, as the screen needs."""
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.floor((t - bound(qe, qn, me, mn, dim)) * (1.0 / (qs * ms))) - 1
    return np.clip(np.where(np.isnan(x), INT32[0], x), *INT32)


def table(q: Q8, stats: np.ndarray, t: float, skip: np.ndarray, width: int) -> np.ndarray:
    """``thresholds``' T for every query row of q against every cluster of ``stats`` ([U, 3]:
    scale, err, norm), as int32 [U, width] (queries along the rows, padded to ``width``):
    INT32_MAX (no sum exceeds it) where ``skip`` ([rows, U] bool), for a cluster without rows
    and in the padding. The same T per pair as ``thresholds``."""
    out = np.full((len(stats), width), INT32[1], np.int32)
    qs, qe, qn = (x[None, :] for x in q.stats())
    ms, me, mn = (x[:, None] for x in stats.T)
    t_ = limit(t, qs, qe, qn, ms, me, mn, q.shape[1])
    keep = ~skip.T & (ms > 0)
    out[:, :len(q)][keep] = t_[keep].astype(np.int32)
    return out


def scaled(x: torch.Tensor, top) -> torch.Tensor:
    """x / top * 127 rounded to int8 (top: x's largest |value|, per row or one; a zero top
    leaves zeros): the layout's assignments, which need no bound."""
    return torch.round(x * (MAX / torch.as_tensor(top).clamp(min=1e-30))).to(torch.int8)


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, d] x b [m, d] int8 -> int32 [n, m]. On CUDA, _int_mm wants > 16 rows and
    multiples of 8: both sides are padded with zero rows, which are cut off."""
    got = kernels.int_mm(a, b)             # a CPU with AMX: the same integers, ~10x the rate
    if got is not None:
        return got
    n, m = len(a), len(b)
    if a.is_cuda:
        a = _pad(a, max(32, -(-n // 8) * 8))
        b = _pad(b, -(-m // 8) * 8)
    return torch._int_mm(a, b.T)[:n, :m]


def products(q: Q8, m: Q8):
    """The block's integer sums [nq, nm] (int32, exact; NumPy on a CPU)."""
    d = int_mm(q.values, m.values)
    return d.numpy() if d.device.type == "cpu" else d


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, n - len(x))) if n > len(x) else x


def _greater(d, t):
    return np.greater(d, t) if isinstance(d, np.ndarray) else d > t


def hits(x: Q8, rows: np.ndarray, m: Q8, floor: float) -> tuple:
    """screen.hits in int8 (spaces.py's one-space blocks): (query index into rows, member
    index) of a superset of the pairs whose fp32 <x[rows], m> is above floor, by each row's
    threshold."""
    q = x.index_select(0, torch.as_tensor(rows, device=x.values.device))
    (t,) = thresholds(q, [(0, len(rows))], np.concatenate(m.stats())[None], [floor])
    hit = kernels.screen_int8(q.values, m.values, None, None, [t], None, 0)
    if hit is not None:                    # the GEMM and compare fused (a CPU with VNNI)
        return np.divmod(hit, len(m))
    d = products(q, m)
    return where(_greater(d, t if isinstance(d, np.ndarray) else
                          torch.as_tensor(t, device=d.device)))


def candidates(q: dict, blocks: list, pairs: tuple, floors: dict, tau_i: float, tau_t: float,
               offsets: np.ndarray, own: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Flat indices (ascending) of the pairs of blocks (q0, q1, m, m_low) that pass the
    candidate rule (screen._rule's: S_ii and S_tt both above tau, or any similarity above its
    floor) on their integer sums; ``offsets``: each block's first flat index. Members without
    a stored copy (m_low None) are quantized as they are read. ``own`` (flat indices,
    ascending) may be left out already (the caller leaves them out either way)."""
    m8 = [m_low or {f: block(v) for f, v in m.items() if v is not None}
          for _, _, m, m_low in blocks]
    spans = [(a, b) for a, b, _, _ in blocks]
    limits = {s: thresholds(q[a], spans, np.array([np.concatenate(m[b].stats()) for m in m8]),
                            [floors[s]] + ([tau_i] if s == "sii" else [tau_t] if s == "stt"
                                           else []))
              for s, a, b in pairs if q.get(a) is not None}
    cut = np.cumsum([0] + [b - a for a, b in spans])
    hit = stacked(q, m8, pairs, spans, limits, offsets, own)
    if hit is not None:
        return hit
    out = [torch.zeros(0, dtype=torch.long, device=q["img"].values.device)]
    for u, (a, b, _, _) in enumerate(blocks):
        at = {s: [t[cut[u]:cut[u + 1]] for t in v] for s, v in limits.items()}
        qu = {f: None if v is None else v[a:b] for f, v in q.items()}
        hit = fused(qu, m8[u], pairs, at, int(offsets[u]))
        out.append(hit if hit is not None else block_flat(
            {s: products(qu[x], m8[u][y]) for s, x, y in pairs if qu.get(x) is not None}, at,
            int(offsets[u])))
    return torch.cat(out)


def stacked(q: dict, m8: list, pairs: tuple, spans: list, limits: dict,
            offsets: np.ndarray, own: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """candidates' answer for every block at once (kernels.screen_blocks: AMX, one call, the
    own pairs left out) where the similarities are S_ii and S_tt alone; None elsewhere (block
    by block, as ``fused``)."""
    if {s for s, x, _ in pairs if q.get(x) is not None} != {"sii", "stt"} or (
            own is not None and own.device.type != "cpu"):
        return None
    hit = kernels.screen_blocks(q["img"].values, q["txt"].values, spans,
                                [(m["img"].values, m["txt"].values) for m in m8],
                                limits["sii"], limits["stt"], offsets[:len(m8)],
                                None if own is None else own.numpy())
    return None if hit is None else torch.from_numpy(hit)


def fused(q: dict, m: dict, pairs: tuple, limits: dict, first: int) -> Optional[torch.Tensor]:
    """block_flat's answer by kernels.screen_int8 (the GEMMs and the rule in one pass, on a CPU
    with AVX512-VNNI) where a block's similarities are S_ii and S_tt alone; None elsewhere."""
    if {s for s, x, _ in pairs if q.get(x) is not None} != {"sii", "stt"}:
        return None
    hit = kernels.screen_int8(q["img"].values, m["img"].values, q["txt"].values,
                             m["txt"].values, limits["sii"], limits["stt"], first)
    return None if hit is None else torch.from_numpy(hit)


def block_flat(sums: dict, limits: dict, first: int) -> torch.Tensor:
    """first + the flat indices (ascending) of one block's pairs that pass ``rule``: in one
    pass in C on a CPU (kernels.screen_pairs), else by ``rule``'s masks."""
    if isinstance(sums["sii"], np.ndarray) and "stt" in sums:
        others = {s: d for s, d in sums.items() if s not in ("sii", "stt")}
        extra = rule(others, limits) if others else None
        hit = kernels.screen_pairs(sums["sii"], sums["stt"], limits["sii"], limits["stt"],
                                  extra, first)
        if hit is not None:
            return torch.from_numpy(hit)
    return flat(rule(sums, limits)) + first


def rule(sums: dict, limits: dict):
    """The rule on one block's integer sums (by similarity) against its rows' thresholds
    (limits: per similarity [floor] or [floor, tau]): a bool [nq, nm] (NumPy on a CPU)."""
    keep = both = None
    for s, d in sums.items():
        floor, *tau = (t if isinstance(d, np.ndarray) else torch.as_tensor(t, device=d.device)
                       for t in limits[s])
        keep = _greater(d, floor) if keep is None else _or(keep, _greater(d, floor))
        if tau:
            both = _greater(d, tau[0]) if both is None else _and(both, _greater(d, tau[0]))
    return keep if both is None else _or(keep, both)


def _or(a, b):
    return np.logical_or(a, b, out=a) if isinstance(a, np.ndarray) else a.logical_or_(b)


def _and(a, b):
    return np.logical_and(a, b, out=a) if isinstance(a, np.ndarray) else a.logical_and_(b)


def flat(keep) -> torch.Tensor:
    """A block's candidates as flat (row-major) indices."""
    if isinstance(keep, np.ndarray):
        return torch.from_numpy(np.flatnonzero(keep))
    return keep.reshape(-1).nonzero().squeeze(1)
