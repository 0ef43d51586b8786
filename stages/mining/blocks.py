"""One neighbour pass in dense blocks (issue 15): HELIP hard pairs (Alg. 1 score and thresholds),
noise support, near-duplicates and FFF Eq. 1 candidate pairs with their exact similarities.

Layout (``build_layout``): spherical k-means of the joint vectors j = [I; T] / sqrt(2) (for unit
I, T: <j_a, j_b> = m = (S_I + S_T) / 2) on a seeded sample, every row assigned to its nearest
centroid, rows sorted by (cluster, row) so that a cluster is a contiguous slice. Per cluster:
its member mean mu_c and radius r_c = max ||j - mu_c||.

Unit of work (``run_unit``): one cluster c. Its members are the queries; the candidates are the
members of the clusters in probe list P_c: the union of every member's ``probe`` nearest
centroids (HELIP's hard pairs are far from a target, so a query at the edge of c still finds
the clusters it needs), ranked by how many members chose each, at most ``max_probe`` of them.
Scores are exact fp32 GEMMs on contiguous slices (no gather, no PQ): S_I and S_T of every
(query, candidate) pair, then

* the HPM score s = S~I * S~T with Alg. 1's thresholds and the duplicate rule (hpm.pair_scores),
  merged into a running top-k, and its support (pairs with s > 0 among the candidates);
* every pair with S_I > floor_i, S_T > floor_t (or, with cross-modal vectors, S_it > floor_x):
  the candidates of FFF Eq. 1 and of HELIP's duplicates, kept with their exact similarities.

Certificate (a proof, not an estimate): a row outside P_c belongs to some cluster c' not probed,
so its joint similarity to q is <q, mu_c'> + <q, j - mu_c'> <= <q, mu_c'> + r_c' (|q| = 1). With
m_out the largest such bound over c' not in P_c, no pair left out scores more than
hpm.score_bound(m_out). A target is certified when its k-th score is >= that bound (its top-k
is exact) or the bound is 0 (no pair left out can score > 0: top-k, support and the noise
decision are all exact). With every cluster probed the pass is exhaustive and equals exact HPM.

Units are independent: ``run_units`` runs them in process, ``ray_units`` on an actor pool; the
result of a unit depends only on the layout and the unit, never on which actor ran it. A unit's
memory is bounded by query_block x block_size scores (plus its slices of the memory-mapped
vectors), whatever the data size.
"""
from __future__ import annotations

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
    probe: int = 16                # nearest centroids per query
    max_probe: int = 48            # clusters per unit (the union of its queries' probes)
    iters: int = 10
    sample: int = 64               # k-means training rows per cluster
    seed: int = 0
    query_block: int = 1024
    block_size: int = 8192

    def clusters(self, n: int) -> int:
        c = self.n_clusters or max(1, round(n / 2048))
        return max(1, min(c, n))


@dataclass
class Layout:
    """Rows sorted by cluster: sorted position p holds global row order[p]; cluster c is
    positions bounds[c]:bounds[c+1]; probes[c] its candidate clusters (-1 padded)."""
    centroids: np.ndarray     # [C, D] unit (assignment)
    means: np.ndarray         # [C, D] member means (the certificate)
    radius: np.ndarray        # [C]
    order: np.ndarray         # [N] int64
    bounds: np.ndarray        # [C + 1] int64
    probes: np.ndarray        # [C, L] int64

    @property
    def n_clusters(self) -> int:
        return len(self.bounds) - 1


def joint_t(i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return torch.cat([i, t], 1) / math.sqrt(2.0)


def _rows(x, a: int, b: int, device: str) -> torch.Tensor:
    return as_tensor(x[a:b], device)


def _assign(img, txt, cent: torch.Tensor, device: str, chunk: int = 65536):
    lab, sim = [], []
    for a in range(0, len(img), chunk):
        m = joint_t(_rows(img, a, a + chunk, device), _rows(txt, a, a + chunk, device)) @ cent.T
        v, j = m.max(1)
        lab.append(j), sim.append(v)
    return torch.cat(lab), torch.cat(sim)


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


def build_layout(img, txt, p: PassParams, device: str = "cpu") -> Layout:
    n = len(img)
    c = p.clusters(n)
    with torch.no_grad():
        cent = kmeans(img, txt, c, p, device)
        lab, _ = _assign(img, txt, cent, device)
        lab = lab.cpu().numpy()
        order = np.lexsort((np.arange(n), lab)).astype(np.int64)   # by cluster, then row
        bounds = np.searchsorted(lab[order], np.arange(c + 1)).astype(np.int64)
        means = np.zeros((c, cent.shape[1]), np.float32)
        radius = np.zeros(c, np.float32)
        probes = np.full((c, min(c, p.max_probe)), -1, np.int64)
        for ci in range(c):
            a, b = bounds[ci], bounds[ci + 1]
            if a == b:
                continue
            rows = np.sort(order[a:b])
            x = joint_t(as_tensor(img[rows], device), as_tensor(txt[rows], device))
            mu = x.mean(0)
            means[ci] = mu.cpu().numpy()
            radius[ci] = float((x - mu).norm(dim=1).max())
            probes[ci] = _probe_list(x @ cent.T, ci, p, probes.shape[1])
    return Layout(cent.cpu().numpy(), means, radius, order, bounds, probes)


def _probe_list(sim: torch.Tensor, own: int, p: PassParams, cap: int) -> np.ndarray:
    """The union of the members' top-``probe`` clusters, most chosen first (ties: the higher
    summed similarity), the unit's own cluster always in; at most ``cap``."""
    c = sim.shape[1]
    top = sim.topk(min(p.probe, c), dim=1).indices.flatten()
    votes = torch.bincount(top, minlength=c).double()
    votes[own] = math.inf
    key = votes * 1e6 + sim.sum(0).double() / max(len(sim), 1)
    chosen = key.topk(min(cap, c)).indices
    chosen = chosen[votes[chosen] > 0].cpu().numpy()
    out = np.full(cap, -1, np.int64)
    out[:len(chosen)] = np.sort(chosen)
    return out


@dataclass
class UnitResult:
    rows: np.ndarray          # [q] global rows of the unit's queries
    idx: np.ndarray           # [q, k] global rows, -1 padded, best first
    score: np.ndarray         # [q, k]
    support: np.ndarray       # [q]
    certified: np.ndarray     # [q] bool
    bound: np.ndarray         # [q] the largest score a pair left out can have
    pairs: dict = field(default_factory=dict)   # q, j (global rows), sii, stt, sit (float32)


class Vectors:
    """The sorted vectors a unit reads: arrays or memmaps [N, d] in layout order."""

    def __init__(self, img, txt, ximg=None, xtxt=None) -> None:
        self.img, self.txt, self.ximg, self.xtxt = img, txt, ximg, xtxt

    @property
    def cross(self) -> bool:
        return self.ximg is not None


def _slices(lay: Layout, probe: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Contiguous sorted ranges covering the probed clusters, each at most ``limit`` rows."""
    ranges: list[list[int]] = []
    for c in probe[probe >= 0]:
        a, b = int(lay.bounds[c]), int(lay.bounds[c + 1])
        if a == b:
            continue
        if ranges and ranges[-1][1] == a:
            ranges[-1][1] = b
        else:
            ranges.append([a, b])
    out = []
    for a, b in ranges:
        out += [(s, min(b, s + limit)) for s in range(a, b, limit)]
    return out


def _bound_out(lay: Layout, q: torch.Tensor, probe: np.ndarray) -> torch.Tensor:
    """Per query: the largest joint similarity any row of an unprobed cluster can have."""
    out = np.ones(lay.n_clusters, bool)
    out[probe[probe >= 0]] = False
    out &= np.diff(lay.bounds) > 0
    if not out.any():
        return torch.full((len(q),), -math.inf, device=q.device)
    mu = torch.as_tensor(lay.means[out], device=q.device)
    r = torch.as_tensor(lay.radius[out], device=q.device)
    return ((q @ mu.T) + r).max(1).values + SLACK


def run_unit(lay: Layout, vec: Vectors, c: int, p: PassParams, device: str = "cpu") -> UnitResult:
    qa, qb = int(lay.bounds[c]), int(lay.bounds[c + 1])
    probe = lay.probes[c]
    parts = [_query_block(lay, vec, a, min(qb, a + p.query_block), probe, p, device)
             for a in range(qa, qb, p.query_block)]
    if not parts:
        return empty_result(p.k)
    pairs = {f: np.concatenate([x.pairs[f] for x in parts]) for f in parts[0].pairs}
    return UnitResult(*(np.concatenate([getattr(x, f) for x in parts])
                        for f in ("rows", "idx", "score", "support", "certified", "bound")), pairs)


def empty_result(k: int) -> UnitResult:
    z = np.zeros(0, np.int64)
    return UnitResult(z, np.zeros((0, k), np.int64), np.zeros((0, k), np.float32), z,
                      np.zeros(0, bool), np.zeros(0, np.float32), {f: np.zeros(0, np.int64 if f in "qj" else np.float32)
                                          for f in ("q", "j", "sii", "stt", "sit")})


def _query_block(lay, vec: Vectors, a: int, b: int, probe, p: PassParams, device) -> UnitResult:
    k, nq = p.k, b - a
    Iq, Tq = _rows(vec.img, a, b, device), _rows(vec.txt, a, b, device)
    Xq = _rows(vec.ximg, a, b, device) if vec.cross else None
    qpos = torch.arange(a, b, device=device)
    best_s = torch.full((nq, k), -1.0, device=device)
    best_j = torch.full((nq, k), -1, dtype=torch.long, device=device)
    support = torch.zeros(nq, dtype=torch.long, device=device)
    found = []
    for s0, s1 in _slices(lay, probe, p.block_size):
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
        best_s, best_j = _merge_block(best_s, best_j, s, s0, k)
    m_out = _bound_out(lay, joint_t(Iq, Tq), probe)
    bound = score_bound(m_out.clamp(max=1.0), p.tau_i, p.tau_t)
    kth = best_s[:, k - 1]
    certified = (bound <= 0) | ((support >= k) & (kth >= bound))
    j, s = _finish(best_s, best_j)
    order = lay.order
    j = canonical(np.where(j >= 0, order[np.maximum(j, 0)], -1), s)
    s = np.take_along_axis(s, j[1], 1)
    j = j[0]
    return UnitResult(order[a:b].copy(), j, s, support.cpu().numpy(), certified.cpu().numpy(),
                      bound.cpu().numpy().astype(np.float32), _pairs(found, order, a))


def canonical(j: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row best first, equal scores by ascending global row (padding last): the order does
    not depend on the layout or the block shapes. Returns (rows, permutation)."""
    key = np.where(j >= 0, j, np.iinfo(np.int64).max)
    perm = np.lexsort((key, -s), axis=1) if len(j) else np.zeros(j.shape, np.int64)
    return np.take_along_axis(j, perm, 1), perm


def _pairs(found, order: np.ndarray, a: int) -> dict:
    if not found:
        return empty_result(1).pairs
    r, j, sii, stt, sit = (torch.cat(x).cpu().numpy() for x in zip(*found))
    return {"q": order[r + a], "j": order[j], "sii": sii.astype(np.float32),
            "stt": stt.astype(np.float32), "sit": sit.astype(np.float32)}


# --- running units ---------------------------------------------------------------------------------
def run_units(lay: Layout, vec: Vectors, p: PassParams, units: Iterable[int],
              device: str = "cpu") -> Iterable[UnitResult]:
    with torch.no_grad():
        for c in units:
            yield run_unit(lay, vec, c, p, device)


@dataclass
class PassResult:
    """Everything the pass found, by global row: top-k, support, certificate, and the pairs in
    CSR form (row g's pairs are pair_*[offsets[g]:offsets[g+1]], sorted by j); ``cut``: pairs
    left out by the per-row cap."""
    idx: np.ndarray
    score: np.ndarray
    support: np.ndarray
    certified: np.ndarray
    offsets: np.ndarray
    pair_j: np.ndarray
    pair_sii: np.ndarray
    pair_stt: np.ndarray
    pair_sit: np.ndarray
    bound: np.ndarray
    cut: int = 0

    @property
    def noise(self) -> np.ndarray:
        return self.support < self.idx.shape[1]

    def certified_at(self, k: int) -> np.ndarray:
        """The certificate for the top-k prefix (k <= the pass's k)."""
        return (self.bound <= 0) | ((self.support >= k) & (self.score[:, k - 1] >= self.bound))


def flops(lay: Layout, dims: int) -> float:
    """Multiply-adds x 2 of every unit's GEMMs: queries x probed rows x (d_I + d_T [+ d_X])."""
    size = np.diff(lay.bounds).astype(np.float64)
    probed = np.array([size[p[p >= 0]].sum() for p in lay.probes])
    return float(2.0 * dims * (size * probed).sum())


def gather(n: int, k: int, results: Iterable[UnitResult], max_pairs: Optional[int] = None
           ) -> PassResult:
    idx = np.full((n, k), -1, np.int64)
    score = np.zeros((n, k), np.float32)
    support = np.zeros(n, np.int64)
    cert = np.zeros(n, bool)
    bound = np.zeros(n, np.float32)
    pairs = []
    for r in results:
        idx[r.rows], score[r.rows], support[r.rows], cert[r.rows] = (r.idx, r.score, r.support,
                                                                       r.certified)
        bound[r.rows] = r.bound
        pairs.append(r.pairs)
    cat = {f: np.concatenate([x[f] for x in pairs]) if pairs else empty_result(1).pairs[f]
           for f in ("q", "j", "sii", "stt", "sit")}
    cut = 0
    if max_pairs is not None and len(cat["q"]):     # the cap: highest similarity first
        best = np.fmax(np.maximum(cat["sii"], cat["stt"]), cat["sit"])
        o = np.lexsort((cat["j"], -best, cat["q"]))
        q = cat["q"][o]
        first = np.searchsorted(q, q)
        keep = o[np.arange(len(q)) - first < max_pairs]
        cut = len(o) - len(keep)
        cat = {f: v[keep] for f, v in cat.items()}
    o = np.lexsort((cat["j"], cat["q"]))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(cat["q"], minlength=n), out=offsets[1:])
    return PassResult(idx, score, support, cert, offsets, cat["j"][o], cat["sii"][o],
                      cat["stt"][o], cat["sit"][o], bound, cut)


def neighbour_pass(img, txt, p: PassParams, ximg=None, xtxt=None, device: str = "cpu",
                   runner: Optional[Callable] = None) -> tuple[Layout, PassResult]:
    """The whole pass in memory (tests, the benchmark): layout, sorted copies, every unit.
    ``runner(lay, vec, p, units)`` -> iterable of UnitResult (default: in process)."""
    lay = build_layout(img, txt, p, device)
    o = lay.order
    vec = Vectors(*(None if x is None else np.ascontiguousarray(x[o], np.float32)
                    for x in (img, txt, ximg, xtxt)))
    units = range(lay.n_clusters)
    results = (runner or (lambda *a: run_units(*a, device=device)))(lay, vec, p, units)
    return lay, gather(len(img), p.k, results)


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
            self.lay, self.p = lay, p
            self.vec = vec if vec_dir is None else load_vectors(vec_dir, len(lay.order))

        def unit(self, c: int) -> UnitResult:
            with torch.no_grad():
                return run_unit(self.lay, self.vec, c, self.p, device)

    def run(lay: Layout, vec: Vectors, p: PassParams, units: Iterable[int]):
        lay_ref = ray.put(lay)
        vec_ref = ray.put(vec if vec_dir is None else None)
        pool = ActorPool([PassActor.remote(lay_ref, vec_ref, p) for _ in range(actors)])
        return pool.map(lambda a, c: a.unit.remote(c), list(units))   # ordered
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
