"""Mining rows: route each to its ``probe`` clusters (routing.py), group the queries by cluster
into units (units.py), run them, and merge (``gather``): each query's ``probe`` partial top-k
lists (canonical order: score, then lower global row), its support summed (clusters are
disjoint, so nothing is counted twice) and its pairs capped. A row's result depends only on
the layout and its own routing, not on which rows are mined with it, on which worker, or in
which order - up to the last bits of its scores (a GEMM's rounding depends on its shape; the
runner's chunks are fixed, run.chunk_rows, so that never depends on resources).

Certificate (a proof, not an estimate): a row of a cluster c' that q did not search has joint
similarity <q, mu_c'> + <q, j - mu_c'> <= <q, mu_c'> + r_c' (|q| = 1). With m_out the largest
such bound over the clusters q did not search, no pair left out scores more than
hpm.score_bound(m_out). A target is certified when its k-th score is >= that bound (its top-k
is exact) or the bound is 0 (no pair left out can score > 0: top-k, support and the noise
decision are all exact). With probe = every cluster the pass is exhaustive: exact HPM. In 768
d a cluster's radius is close to 1, so with probe < all clusters it certifies almost no
target: it is a proof (tested at k = 5 and 500), not a recall estimate; recall at the defaults
is measured in tests/benchmarks/bench_mining.py.

Memory: mining q rows holds q x (k + max_pairs) results (pairs are capped per row as member
blocks arrive, whatever a cluster's size) and query_block x block_size scores (plus slices of
the memory-mapped sorted vectors), whatever N is."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np
import torch

from .. import native
from ..hpm import score_bound
from .core import PassParams, Vectors, freed_memory_kept
from .count import count
from .layout import Layout
from .pairs import Held, csr
from .precision import get
from .routing import route
from .topk import Best
from .units import Queries, UnitResult, run_stack, run_unit, stacks


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


def mine_routed(lay: Layout, vec: Vectors, pos: np.ndarray, p: PassParams, device: str = "cpu",
                routed: Optional[tuple] = None) -> tuple[PassResult, np.ndarray]:
    """Mine the rows at sorted positions ``pos`` (engine.mine's first step), with each row's
    routes (spaces.add_pairs reads them); with p.exact_noise the support of rows found short
    completed (``complete``)."""
    pos = np.asarray(pos, np.int64)
    kept = lay.kept(("scratch", threading.get_ident()), dict)    # this thread's, per layout
    with freed_memory_kept(), native.scratch_kept(kept):
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
    by routing: most rows near the threshold reach k there); for those still short, the
    supporters in every other cluster are counted (count.py: one space's screen, the other's
    similarity only where it passes, stopped once a row reaches k). A row that reaches k is
    searched in every cluster left; the others only in the clusters holding a possible
    supporter (no other pair of theirs has a positive score). Their support is then exact
    (clusters are disjoint: counts add), so is their noise decision, and after the last step
    their top-k and certificate too. In place on ``r``; only the top-k, support, bound and
    certificate of those rows change (their candidate pairs are the pass's: the searches
    keep none)."""
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
    for a in range(0, len(short), step):
        _last_step(lay, vec, pos, r, short[a:a + step], searched[a:a + step], q, device)


def _last_step(lay: Layout, vec: Vectors, pos: np.ndarray, r: PassResult, rows: np.ndarray,
               searched: np.ndarray, p: PassParams, device: str) -> None:
    """``complete``'s last step for short ``rows`` (``searched``: their clusters searched so
    far): counted (count.py), then searched in every cluster left (rows that reach k) or in
    those holding a possible supporter (the others); nothing is left to bound. In fp32 (a
    precision that does not re-score) every row is searched in every cluster left: its
    similarities are read off the GEMMs, whose last bits follow their shapes, and a search
    of fewer clusters would stack other GEMMs."""
    done = searched | (np.diff(lay.bounds) == 0)
    every = np.arange(lay.n_clusters)[None, :]
    reached, possible = (count(lay, vec, pos[rows], done, p.k - r.support[rows], p, device)
                         if get(p.precision).rescores else (np.ones(len(rows), bool), done))
    for pick, where in ((reached, ~done), (~reached, possible & ~done)):
        if pick.any():
            _search(lay, vec, pos, r, rows[pick], np.where(where[pick], every, -1),
                    np.full(int(pick.sum()), -np.inf, np.float32), p, device)


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
