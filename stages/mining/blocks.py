"""One neighbour pass in dense blocks (issue 15): HELIP hard pairs (Alg. 1 score and thresholds),
noise support, near-duplicates and FFF Eq. 1 candidate pairs with their exact similarities.

Layout (``build_layout``): spherical k-means of the joint vectors j = [I; T] / sqrt(2) (for unit
I, T: <j_a, j_b> = m = (S_I + S_T) / 2) on a seeded sample, every row assigned to its nearest
centroid, rows sorted by (cluster, row) so that a cluster is a contiguous slice. Per cluster:
its member mean mu_c and radius r_c = max ||j - mu_c||.

Routing: each row (query) searches the ``probe`` clusters whose means are nearest to its joint
vector, its own among them (IVF's nprobe, with exact scores). Grouped by cluster, this gives the
units of work (``run_unit``): cluster c and every query routed to it. Scores are exact fp32
GEMMs of the gathered queries (query_block at a time) against c's members (a contiguous slice,
block_size at a time; no PQ): S_I and S_T of every (query, member) pair, then

* the HPM score s = S~I * S~T with Alg. 1's thresholds and the duplicate rule (hpm.pair_scores),
  merged into a running top-k, and its support (pairs with s > 0 among c's members);
* every pair with S_I > floor_i, S_T > floor_t (or, with cross-modal vectors, S_it > floor_x):
  the candidates of FFF Eq. 1 and of HELIP's duplicates, kept with their exact similarities.

``gather`` merges a query's ``probe`` partial top-k lists (canonical order: score, then lower
global row) and sums its supports (clusters are disjoint, so nothing is counted twice).

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
not a recall estimate; recall at the defaults is measured there instead (issue 12).

Units are independent: ``run_units`` runs them in process, ``ray_units`` on an actor pool; the
result of a unit depends only on the layout and the unit, never on which actor ran it. A unit's
memory is bounded by query_block x block_size scores (plus its slices of the memory-mapped
vectors), whatever the data size.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from .hpm import _finish, _merge_block, as_tensor, pair_scores, score_bound

SLACK = 1e-5          # fp32 rounding of <q, mu> + r: the certificate's bound is raised by this


@dataclass(frozen=True)
class PassParams:
    k: int
    tau_i: float
    tau_t: float
    dup: Optional[float] = 0.98
    floor_i: float = 2.0           # keep pairs with S_I > floor_i (2.0: none)
    floor_t: float = 2.0
    floor_x: float = 2.0           # S_it > floor_x (needs cross-modal vectors)
    n_clusters: Optional[int] = None   # None: auto (clusters of about 2048 rows)
    probe: int = 40                # clusters searched per query (all: exhaustive)
    iters: int = 10
    sample: int = 64               # k-means training rows per cluster
    seed: int = 0
    query_block: int = 1024
    block_size: int = 8192
    max_pairs: Optional[int] = None    # candidate pairs kept per row (highest similarity first)

    def clusters(self, n: int) -> int:
        c = self.n_clusters or max(1, round(n / 2048))
        return max(1, min(c, n))


@dataclass
class Layout:
    """Rows sorted by cluster: sorted position p holds global row order[p]; cluster c is
    positions bounds[c]:bounds[c+1]. Routing: the queries (sorted positions, ascending) that
    search cluster c are route_q[route_off[c]:route_off[c+1]]; m_out[p] bounds the joint
    similarity of query p to any row of a cluster it does not search."""
    means: np.ndarray         # [C, D] member means
    radius: np.ndarray        # [C]
    order: np.ndarray         # [N] int64
    bounds: np.ndarray        # [C + 1] int64
    route_off: np.ndarray     # [C + 1] int64
    route_q: np.ndarray       # [N x probe] int64
    m_out: np.ndarray         # [N] float32, by sorted position

    @property
    def n_clusters(self) -> int:
        return len(self.bounds) - 1

    def queries(self, c: int) -> np.ndarray:
        return self.route_q[self.route_off[c]:self.route_off[c + 1]]

    def light(self) -> "Layout":
        """What a unit needs besides its queries: the order and the cluster bounds (an actor's
        copy; 8 bytes per row)."""
        z = np.zeros(0, np.float32)
        return Layout(z.reshape(0, 0), z, self.order, self.bounds,
                      np.zeros(len(self.bounds), np.int64), np.zeros(0, np.int64), z)


def joint_t(i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.cat([i, t], 1) / math.sqrt(2.0)


def _rows(x, a: int, b: int, device: str) -> torch.Tensor:
    return as_tensor(x[a:b], device)


def _joint_sims(img, txt, cent: torch.Tensor, device: str, chunk: int = 32768):
    """Per chunk of rows (in table order): (first row, [rows, C] joint similarities to cent)."""
    for a in range(0, len(img), chunk):
        yield a, joint_t(_rows(img, a, a + chunk, device), _rows(txt, a, a + chunk, device)) @ cent.T


def kmeans(img, txt, c: int, p: PassParams, device: str = "cpu") -> torch.Tensor:
    """Spherical k-means on a seeded sample of the joint vectors; unit centroids [c, D]."""
    n = len(img)
    rng = np.random.default_rng(p.seed)
    pick = np.sort(rng.choice(n, size=min(n, p.sample * c), replace=False))
    x = joint_t(as_tensor(img[pick], device), as_tensor(txt[pick], device))
    cent = x[torch.as_tensor(np.sort(rng.choice(len(x), size=c, replace=False)), device=device)]
    for _ in range(p.iters):
        lab = (x @ cent.T).argmax(1)
        s = torch.zeros_like(cent).index_add_(0, lab, x)
        empty = s.norm(dim=1) == 0
        s[empty] = cent[empty]                       # an empty cluster keeps its centroid
        cent = s / s.norm(dim=1, keepdim=True)
    return cent


def _chunks(img, txt, device: str, chunk: int = 32768):
    for a in range(0, len(img), chunk):
        yield a, joint_t(_rows(img, a, a + chunk, device), _rows(txt, a, a + chunk, device))


def build_layout(img, txt, p: PassParams, device: str = "cpu") -> Layout:
    """k-means, assignment, member means and radii, then routing: each row searches the
    ``probe`` clusters whose means are nearest to it (its own always among them), and
    m_out = max over the others of <q, mu_c> + r_c (the certificate's bound)."""
    n = len(img)
    c = p.clusters(n)
    with torch.no_grad():
        cent = kmeans(img, txt, c, p, device)
        lab = torch.cat([m.argmax(1) for _, m in _joint_sims(img, txt, cent, device)]).cpu().numpy()
        labt = torch.as_tensor(lab, device=device)
        order = np.lexsort((np.arange(n), lab)).astype(np.int64)   # by cluster, then row
        bounds = np.searchsorted(lab[order], np.arange(c + 1)).astype(np.int64)
        sums = torch.zeros(cent.shape, dtype=torch.float64, device=device)
        for a, x in _chunks(img, txt, device):
            sums.index_add_(0, labt[a:a + len(x)], x.double())
        size = torch.as_tensor(np.diff(bounds), device=device).clamp(min=1).unsqueeze(1)
        means = (sums / size).float()
        radius = torch.zeros(c, device=device)
        for a, x in _chunks(img, txt, device):
            la = labt[a:a + len(x)]
            radius = radius.scatter_reduce(0, la, (x - means[la]).norm(dim=1), "amax")
        route, m_out = _route(img, txt, means, radius, labt, np.diff(bounds) == 0,
                              min(p.probe, c), device)
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)
    probe = route.shape[1]
    rq, rc = pos.repeat(probe), route.ravel()
    o = np.lexsort((rq, rc))
    route_off = np.searchsorted(rc[o], np.arange(c + 1)).astype(np.int64)
    m_sorted = np.where(np.isfinite(m_out), m_out + SLACK, -np.inf).astype(np.float32)[order]
    return Layout(means.cpu().numpy(), radius.cpu().numpy(), order, bounds, route_off, rq[o],
                  m_sorted)


def restrict(lay: Layout, rows: np.ndarray) -> Layout:
    """The same layout with only ``rows`` (global) as queries: their results are complete, the
    other rows are not mined (the benchmark's sampled targets)."""
    keep = np.isin(lay.order[lay.route_q], rows)
    counts = np.add.reduceat(keep, lay.route_off[:-1]) if len(keep) else np.zeros(0, np.int64)
    counts = np.where(np.diff(lay.route_off) > 0, counts, 0)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return Layout(lay.means, lay.radius, lay.order, lay.bounds, off, lay.route_q[keep], lay.m_out)


def _route(img, txt, means, radius, labt, empty_np, probe: int, device):
    """Per row: its ``probe`` nearest non-empty clusters by <q, mu_c> (its own first), and the
    bound max over the other non-empty clusters of <q, mu_c> + r_c (-inf when none)."""
    n, c = len(img), len(means)
    route = np.empty((n, probe), np.int64)
    m_out = np.full(n, -np.inf, np.float32)
    empty = torch.as_tensor(empty_np, device=device)
    for a, m in _joint_sims(img, txt, means, device):
        own = labt[a:a + len(m)].unsqueeze(1)
        m.masked_fill_(empty, -math.inf)
        key = m.clone().scatter_(1, own, math.inf)
        top = key.topk(probe, dim=1).indices
        route[a:a + len(m)] = top.cpu().numpy()
        if probe < c:
            m.add_(radius.unsqueeze(0)).scatter_(1, top, -math.inf)
            m_out[a:a + len(m)] = m.max(1).values.cpu().numpy()
    return route, m_out


@dataclass
class UnitResult:
    rows: np.ndarray          # [q] global rows of the unit's queries
    idx: np.ndarray           # [q, k] global rows, -1 padded, best first (within the unit)
    score: np.ndarray         # [q, k]
    support: np.ndarray       # [q] pairs with s > 0 within the unit
    pairs: dict = field(default_factory=dict)   # q, j (global rows), sii, stt, sit (float32)
    cut: int = 0              # pairs the per-row cap left out already (within the unit)


class Vectors:
    """The sorted vectors a unit reads: arrays or memmaps [N, d] in layout order."""

    def __init__(self, img, txt, ximg=None, xtxt=None) -> None:
        self.img, self.txt, self.ximg, self.xtxt = img, txt, ximg, xtxt

    @property
    def cross(self) -> bool:
        return self.ximg is not None


def run_unit(lay: Layout, vec: Vectors, c: int, p: PassParams, device: str = "cpu",
             qs: Optional[np.ndarray] = None) -> UnitResult:
    """Cluster c: every query routed to it (``qs``, sorted positions; default from the layout;
    gathered query_block at a time) against its members (a contiguous slice, block_size at a
    time)."""
    qs = lay.queries(c) if qs is None else qs
    parts = [_query_block(lay, vec, qs[a:a + p.query_block], c, p, device)
             for a in range(0, len(qs), p.query_block)]
    if not parts:
        return empty_result(p.k)
    pairs = {f: np.concatenate([x.pairs[f] for x in parts]) for f in parts[0].pairs}
    return UnitResult(*(np.concatenate([getattr(x, f) for x in parts])
                        for f in ("rows", "idx", "score", "support")), pairs,
                      sum(x.cut for x in parts))


def empty_result(k: int) -> UnitResult:
    z = np.zeros(0, np.int64)
    return UnitResult(z, np.zeros((0, k), np.int64), np.zeros((0, k), np.float32), z,
                      {f: np.zeros(0, np.int64 if f in "qj" else np.float32)
                       for f in ("q", "j", "sii", "stt", "sit")})


def _take(x, pos: np.ndarray, device: str) -> Optional[torch.Tensor]:
    return None if x is None else as_tensor(x[pos], device)


def _query_block(lay, vec: Vectors, qpos_np: np.ndarray, c: int, p: PassParams,
                 device) -> UnitResult:
    k, nq = p.k, len(qpos_np)
    Iq, Tq, Xq = (_take(x, qpos_np, device) for x in (vec.img, vec.txt, vec.ximg))
    qpos = torch.as_tensor(qpos_np, device=device)
    best_s = torch.full((nq, k), -1.0, device=device)
    best_j = torch.full((nq, k), -1, dtype=torch.long, device=device)
    support = torch.zeros(nq, dtype=torch.long, device=device)
    found = []
    a, b = int(lay.bounds[c]), int(lay.bounds[c + 1])
    for s0 in range(a, b, p.block_size):
        s1 = min(b, s0 + p.block_size)
        si = Iq @ _rows(vec.img, s0, s1, device).T
        st = Tq @ _rows(vec.txt, s0, s1, device).T
        sx = Xq @ _rows(vec.xtxt, s0, s1, device).T if vec.cross else None
        own = ((qpos >= s0) & (qpos < s1)).nonzero().flatten()
        keep = (si > p.floor_i) | (st > p.floor_t)
        if sx is not None:
            keep |= sx > p.floor_x
        keep[own, qpos[own] - s0] = False                    # the target itself
        r, cc = keep.nonzero(as_tuple=True)
        if len(r):
            found.append((r, cc + s0, si[r, cc], st[r, cc],
                          sx[r, cc] if sx is not None else torch.full_like(si[r, cc], math.nan)))
        s = pair_scores(si, st, p.tau_i, p.tau_t, p.dup)
        s[own, qpos[own] - s0] = 0.0
        support += torch.count_nonzero(s, dim=1)         # s >= 0: thresholds are >= 0
        if s1 - s0 == b - a:                             # one block: its top-k is the result
            v, jj = s.topk(min(k, s1 - s0), dim=1)
            best_s[:, :v.shape[1]], best_j[:, :v.shape[1]] = v, jj + s0
        else:
            best_s, best_j = _merge_block(best_s, best_j, s, s0, k)
    j, s = _finish(best_s, best_j)
    order = lay.order
    j = np.where(j >= 0, order[np.maximum(j, 0)], -1)
    # a query block's pairs are capped per row at once (a row's best max_pairs overall are among
    # its best in each block): a unit holds at most query_block x max_pairs pairs a block
    pairs, cut = _cap(_pairs(found, order, qpos_np), p.max_pairs)
    return UnitResult(order[qpos_np], j, s, support.cpu().numpy(), pairs, cut)


def canonical(j: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row best first, equal scores by ascending global row (padding last): the order does
    not depend on the layout, the units or the block shapes. Returns (rows, permutation)."""
    key = np.where(j >= 0, j, np.iinfo(np.int64).max)
    perm = np.lexsort((key, -s), axis=1) if len(j) else np.zeros(j.shape, np.int64)
    return np.take_along_axis(j, perm, 1), perm


def _pairs(found, order: np.ndarray, qpos: np.ndarray) -> dict:
    if not found:
        return empty_result(1).pairs
    r, j, sii, stt, sit = (torch.cat(x).cpu().numpy() for x in zip(*found))
    return {"q": order[qpos[r]], "j": order[j], "sii": sii.astype(np.float32),
            "stt": stt.astype(np.float32), "sit": sit.astype(np.float32)}


# --- running units ---------------------------------------------------------------------------------
def run_units(lay: Layout, vec: Vectors, p: PassParams, units: Iterable[int],
              device: str = "cpu") -> Iterable[UnitResult]:
    with torch.no_grad():
        for c in units:
            yield run_unit(lay, vec, c, p, device)


@dataclass
class Found:
    """What the pass found, by global row: top-k, support, certificate, and the pairs in CSR form
    (row g's pairs are pair_*[offsets[g]:offsets[g+1]], sorted by j). What it persists."""
    idx: np.ndarray
    score: np.ndarray
    support: np.ndarray
    certified: np.ndarray
    offsets: np.ndarray
    pair_j: np.ndarray
    pair_sii: np.ndarray
    pair_stt: np.ndarray
    pair_sit: np.ndarray


@dataclass
class PassResult(Found):
    """The pass's result in memory, plus ``bound``: the largest score a pair outside the searched
    clusters can have, and ``cut``: pairs left out by the per-row cap."""
    bound: np.ndarray
    cut: int = 0

    @property
    def noise(self) -> np.ndarray:
        return self.support < self.idx.shape[1]

    def certified_at(self, k: int) -> np.ndarray:
        """The certificate for the top-k prefix (k <= the pass's k)."""
        return (self.bound <= 0) | ((self.support >= k) & (self.score[:, k - 1] >= self.bound))


def flops(lay: Layout, dims: int, units: Optional[Iterable[int]] = None) -> float:
    """Multiply-adds x 2 of the units' GEMMs: routed queries x members x (d_I + d_T [+ d_X])."""
    cs = np.arange(lay.n_clusters) if units is None else np.asarray(list(units))
    q = (lay.route_off[cs + 1] - lay.route_off[cs]).astype(np.float64)
    m = (lay.bounds[cs + 1] - lay.bounds[cs]).astype(np.float64)
    return float(2.0 * dims * (q * m).sum())


def merge_rows(idx, score, rows, j, s, k: int) -> None:
    """idx/score[rows] <- the best k of theirs and (j, s), in place (torch.topk: on a tie at the
    k-th place the earlier unit's entry stays; the final order is made canonical in gather)."""
    cj = torch.from_numpy(np.concatenate([idx[rows], j], 1))
    cs = torch.from_numpy(np.concatenate([score[rows], s], 1))
    v, t = cs.topk(k, dim=1, sorted=False)
    idx[rows], score[rows] = cj.gather(1, t).numpy(), v.numpy()


def gather(lay: Layout, k: int, tau: tuple[float, float], results: Iterable[UnitResult],
           max_pairs: Optional[int] = None) -> PassResult:
    """Merge the units' partial top-k (a query is searched by ``probe`` units), sum their
    support, and certify: bound = score_bound(m_out). ``max_pairs``: the pass's
    ``PassParams.max_pairs``, which its units applied too."""
    n = len(lay.order)
    idx = np.full((n, k), -1, np.int64)
    score = np.zeros((n, k), np.float32)
    support = np.zeros(n, np.int64)
    pairs, held, cut = [], 0, 0
    for r in results:
        cut += r.cut
        merge_rows(idx, score, r.rows, r.idx, r.score, k)
        np.add.at(support, r.rows, r.support)
        pairs.append(r.pairs)
        held += len(r.pairs["q"])
        if max_pairs is not None and held > 2 * n * max_pairs + COMPACT_SLACK:
            # a row's best max_pairs of all its pairs are the best of its best so far and the
            # new ones: capping as units arrive is exact, and holds ~ n * max_pairs pairs
            capped, dropped = _cap(_concat(pairs), max_pairs)
            pairs, held, cut = [capped], len(capped["q"]), cut + dropped
    idx[score <= 0] = -1
    score[score <= 0] = 0.0
    idx, perm = canonical(idx, score)
    score = np.take_along_axis(score, perm, 1)
    m_out = np.empty(n, np.float32)
    m_out[lay.order] = lay.m_out
    bound = score_bound(torch.from_numpy(m_out).clamp(max=1.0), *tau).numpy()
    cert = (bound <= 0) | ((support >= k) & (score[:, k - 1] >= bound))
    cat, dropped = _cap(_concat(pairs), max_pairs)
    cut += dropped
    o = np.lexsort((cat["j"], cat["q"]))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(cat["q"], minlength=n), out=offsets[1:])
    return PassResult(idx, score, support, cert, offsets, cat["j"][o], cat["sii"][o],
                      cat["stt"][o], cat["sit"][o], bound, cut)


COMPACT_SLACK = 1 << 20    # pairs held beyond 2 x n x max_pairs before gather caps them


def _concat(pairs: list[dict]) -> dict:
    return {f: np.concatenate([x[f] for x in pairs]) if pairs else empty_result(1).pairs[f]
            for f in ("q", "j", "sii", "stt", "sit")}


def _cap(cat: dict, max_pairs: Optional[int]) -> tuple[dict, int]:
    """At most max_pairs pairs per row, highest max(S_ii, S_tt, S_it) first."""
    if max_pairs is None or not len(cat["q"]):
        return cat, 0
    best = np.fmax(np.maximum(cat["sii"], cat["stt"]), cat["sit"])
    o = np.lexsort((cat["j"], -best, cat["q"]))
    q = cat["q"][o]
    keep = o[np.arange(len(q)) - np.searchsorted(q, q) < max_pairs]
    return {f: v[keep] for f, v in cat.items()}, len(o) - len(keep)


def neighbour_pass(img, txt, p: PassParams, ximg=None, xtxt=None, device: str = "cpu",
                   runner: Optional[Callable] = None, max_pairs: Optional[int] = None
                   ) -> tuple[Layout, PassResult]:
    """The whole pass in memory (tests, the benchmark): layout, sorted copies, every unit.
    ``runner(lay, vec, p, units)`` -> iterable of UnitResult (default: in process)."""
    p = p if max_pairs is None else dataclasses.replace(p, max_pairs=max_pairs)
    lay = build_layout(img, txt, p, device)
    o = lay.order
    vec = Vectors(*(None if x is None else np.ascontiguousarray(x[o], np.float32)
                    for x in (img, txt, ximg, xtxt)))
    units = range(lay.n_clusters)
    results = (runner or (lambda *a: run_units(*a, device=device)))(lay, vec, p, units)
    return lay, gather(lay, p.k, (p.tau_i, p.tau_t), results, p.max_pairs)


def ray_units(actors: int, num_cpus: float = 1, num_gpus: float = 0, device: str = "cpu",
              vec_dir: Optional[str] = None):
    """A runner for neighbour_pass / the stage: the units on a pool of Ray actors. Each actor
    gets the layout and the (sorted) vectors once - from ``vec_dir`` memory-mapped files when
    given, else through the object store - and returns one UnitResult per unit, in unit order."""
    import ray
    from ray.util import ActorPool

    @ray.remote(num_cpus=num_cpus, num_gpus=num_gpus)
    class PassActor:
        def __init__(self, lay, vec, p) -> None:
            torch.set_num_threads(max(1, int(num_cpus)))   # its share of the node, no more
            self.lay, self.p = lay, p
            self.vec = vec if vec_dir is None else load_vectors(vec_dir, len(lay.order))

        def unit(self, c: int, qs: np.ndarray) -> UnitResult:
            with torch.no_grad():
                return run_unit(self.lay, self.vec, c, self.p, device, qs)

    def run(lay: Layout, vec: Vectors, p: PassParams, units: Iterable[int]):
        lay_ref = ray.put(lay.light())
        vec_ref = ray.put(vec if vec_dir is None else None)
        pool = ActorPool([PassActor.remote(lay_ref, vec_ref, p) for _ in range(actors)])
        return pool.map(lambda a, c: a.unit.remote(c, lay.queries(c)), list(units))  # ordered
    return run


# --- sorted vectors on disk ----------------------------------------------------------------------
NAMES = ("img", "txt", "ximg", "xtxt")


def save_vectors(dir_: str, lay: Layout, arrays: dict, chunk: int = 65536) -> None:
    """Write each [N, d] array of ``arrays`` (keys in NAMES) in layout order, float32."""
    os.makedirs(dir_, exist_ok=True)
    for name, x in arrays.items():
        if x is None:
            continue
        with open(os.path.join(dir_, f"{name}.f32"), "wb") as fh:
            for a in range(0, len(lay.order), chunk):
                rows = lay.order[a:a + chunk]
                fh.write(np.ascontiguousarray(x[np.sort(rows)][np.argsort(np.argsort(rows))],
                                              np.float32).tobytes())
        with open(os.path.join(dir_, f"{name}.dim"), "w") as fh:
            fh.write(str(x.shape[1]))


def load_vectors(dir_: str, n: int) -> Vectors:
    out = []
    for name in NAMES:
        path = os.path.join(dir_, f"{name}.f32")
        if not os.path.exists(path):
            out.append(None)
            continue
        with open(os.path.join(dir_, f"{name}.dim")) as fh:
            d = int(fh.read())
        out.append(np.memmap(path, np.float32, "r", shape=(n, d)) if n else
                   np.zeros((0, d), np.float32))
    return Vectors(*out)
