"""HELIP hard-pair mining (Wang et al., sec. 3.2, Algorithms 1 and 2): pure algorithms, no I/O.

For a target pair i and every other pair j (Alg. 1):

    S~I_j = cos(I_i, I_j) if cos(I_i, I_j) > tau_I else 0        (same for text, with tau_T)
    s_j   = S~I_j * S~T_j

The hard set H_i is the top-k of s (the target excluded, Eq. 2: D_i = D minus z_i). The target is a
*noise pair* when a top-k score is 0, i.e. fewer than k pairs have s_j > 0 ("support" it); Alg. 1
then sets H_i to the empty set.

Choices where the paper is ambiguous (tested in tests/stages/mining/):

* threshold: Alg. 1 keeps a similarity when it is ``> tau`` (the prose says values ``< tau`` are
  zeroed); we follow Alg. 1, so a similarity exactly equal to tau is zeroed.
* duplicates: HELIP's released code zeroes similarities above 0.98 ("potential duplication")
  before the product. We do the same per modality with ``dup`` (None = off): a pair with
  S_I > dup or S_T > dup scores 0, so it is neither a hard pair nor support for the noise rule;
  the positives stage lists it as a positive instead.
* ties between equal scores: the lower row index wins, except inside a block scanned while a
  target's top-k is still filling, where the order is torch.topk's (deterministic per device).
* FastHPM samples one candidate pool for all targets (the released code also reuses one sample
  for 300k targets); a target in the pool is excluded from its own candidates by index.

FastHPM here indexes the joint vector j = [I; T] / sqrt(2) of the pool with FAISS IVF-PQ. For
unit vectors <j_a, j_b> = m = (S_I + S_T) / 2, the mean of the two similarities, and by AM-GM
s = S_I * S_T <= m^2. Candidates are the top-k' pool pairs by m; they are re-scored exactly.
*Certificate*: every pair not retrieved has m <= m_k' (the k'-th retrieved), so its score is at
most bound(m_k') = m_k'^2 (0 when 2 m_k' <= tau_I + tau_T: one similarity is then below its
threshold). When the k-th re-scored product is >= that bound, the top-k is exact and so is the
noise decision. This holds when the joint search is exact; IVF-PQ only estimates m_k' (PQ
error, unprobed lists), so we raise it by the target's largest underestimate among its own
candidates (exact m minus the PQ estimate). On the real-derived 65k set with the default search
(nprobe 64, k' 200) the plain test certifies 99.9% of targets, of which 88% are exact; the raised
one certifies 56%, of which 96% are exact (tests/benchmarks/bench_mining.py).
Uncertified targets can be searched again with k' x 4 (``widen``): by default only those about
to be flagged as noise pairs, since a wrong noise flag drops a good pair, while an approximate
hard set only costs a little hardness.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as TF

from vlcurate.foundation import models

WIDEN = 4          # k' multiplier for uncertified targets


# --- devices ------------------------------------------------------------------------------------
def resolve_device(device: str = "auto") -> str:
    return models.resolve_device(device, "hpm.device")


def faiss_gpu_available() -> bool:
    import faiss
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


def as_tensor(x, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A ``dtype`` tensor on ``device``; a read-only memmap is shared, not copied (never
    written)."""
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype)
    _quiet()
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=_numpy_dtype(dtype)))
    return x if device == "cpu" else x.to(device)


@functools.lru_cache(maxsize=None)
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


@functools.lru_cache(maxsize=None)
def _quiet() -> None:
    """torch warns once per process that a read-only array's tensor must not be written (we
    never write one): that one warning is spent here, silenced (as_tensor runs ~15,000 times
    per 8,192 targets; a catch_warnings around each cost ~1/5 of its time)."""
    x = np.zeros(1, np.float32)
    x.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(x)


def normalize(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


# --- the score ------------------------------------------------------------------------------------
def pair_scores(si: torch.Tensor, st: torch.Tensor, tau_i: float, tau_t: float,
                dup: Optional[float]) -> torch.Tensor:
    """Alg. 1's s_j from the two cosine similarities, in place on ``si`` (``st`` is clobbered)."""
    if dup is not None:
        si.masked_fill_(si > dup, 0.0)
        st.masked_fill_(st > dup, 0.0)
    TF.threshold_(si, tau_i, 0.0)          # x if x > tau else 0
    TF.threshold_(st, tau_t, 0.0)
    return si.mul_(st)


def score_bound(m: torch.Tensor, tau_i: float, tau_t: float) -> torch.Tensor:
    """Largest score a pair whose mean similarity is <= m can have: m^2, or 0 when one of its
    similarities must be below its threshold (2 m <= tau_I + tau_T)."""
    return torch.where(2 * m > tau_i + tau_t, m.clamp(min=0) ** 2, torch.zeros_like(m))


@dataclass
class TopK:
    """Per target: up to k best pairs with a positive score (global row indices, -1 padded, best
    first), how many pairs support it, and whether the top-k is certified exact."""
    idx: np.ndarray          # [q, k] int64
    score: np.ndarray        # [q, k] float32
    support: np.ndarray      # [q] int64
    certified: np.ndarray    # [q] bool

    @property
    def noise(self) -> np.ndarray:
        """HELIP's rule: a top-k score is 0, i.e. fewer than k pairs support the target."""
        k = self.idx.shape[1]
        return self.support < k


def noise_pairs(support: np.ndarray, siblings: np.ndarray, k: int) -> np.ndarray:
    """HELIP's rule with siblings (engine/siblings.py): fewer than k pairs and agreeing other
    captions of the target's image support it (no siblings: Alg. 1's rule, TopK.noise)."""
    return np.asarray(support, np.int64) + np.asarray(siblings, np.int64) < k


def merge_topk(best_s: torch.Tensor, best_j: torch.Tensor, s: torch.Tensor, j: torch.Tensor,
               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k best of two candidate lists; on equal scores the earlier list (lower indices)
    wins (stable sort)."""
    cs, cj = torch.cat([best_s, s], 1), torch.cat([best_j, j], 1)
    order = torch.sort(cs, dim=1, descending=True, stable=True).indices[:, :k]
    return cs.gather(1, order), cj.gather(1, order)


def _finish(best_s: torch.Tensor, best_j: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    s = best_s.cpu().numpy().astype(np.float32)
    j = best_j.cpu().numpy().astype(np.int64)
    j[s <= 0] = -1
    s[s <= 0] = 0.0
    return j, s


def stable_topk(key: torch.Tensor, k: int, floor: float = 0.0) -> torch.Tensor:
    """Column indices of each row's k largest keys, largest first, equal keys >= ``floor`` by
    ascending column (torch.topk breaks ties in any order; a full stable sort of a wide block
    costs ~20x a top-k): ``top_columns``, ordered. Keys below ``floor`` (rank_key's -1: not a
    positive) are never kept, so their order is moot."""
    cols = top_columns(key, k, floor)
    order = torch.sort(key.gather(1, cols), dim=1, descending=True, stable=True).indices
    return cols.gather(1, order)


def top_columns(key: torch.Tensor, k: int, floor: float = -math.inf) -> torch.Tensor:
    """Each row's k largest keys' columns, ascending, equal keys >= ``floor`` by ascending
    column. Only rows where equal keys straddle the k-th place are re-picked: every key above
    the k-th value, then the first columns equal to it."""
    if k == 0 or key.shape[1] == 0:
        return torch.zeros((key.shape[0], 0), dtype=torch.long, device=key.device)
    v, top = key.topk(k, dim=1)
    kth = v[:, -1:]
    rows = (kth[:, 0] >= floor).nonzero().flatten()
    if len(rows):
        sub, th = key[rows], kth[rows]
        tied = (sub == th).sum(1) > (v[rows] == th).sum(1)
        rows, sub, th = rows[tied], sub[tied], th[tied]
    if len(rows):
        equal = sub == th
        room = (k - (sub > th).sum(1)).unsqueeze(1)
        pick = (sub > th) | (equal & (equal.cumsum(1) <= room))
        top[rows] = pick.nonzero()[:, 1].view(len(rows), k)
    return top.sort(dim=1).values


def positive_pairs(si: torch.Tensor, st: torch.Tensor, tau_i: float, tau_t: float,
                   dup: Optional[float], own_r: torch.Tensor, own_c: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's pairs with s > 0 (Alg. 1: tau < S <= dup in both spaces), the targets
    themselves (own_r, own_c) left out: (rows, columns, s), row-major. The same values as
    pair_scores (the same fp32 product) in three dense passes instead of its seven: most pairs
    are below a threshold, and only the rest are gathered."""
    hit = (si > tau_i).logical_and_(st > tau_t)
    hit[own_r, own_c] = False
    r, c = hit.nonzero(as_tuple=True)
    ok, v = positive_scores(si[r, c], st[r, c], tau_i, tau_t, dup)
    return r[ok], c[ok], v[ok]


def positive_scores(a: torch.Tensor, b: torch.Tensor, tau_i: float, tau_t: float,
                    dup: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 1 on listed pairs (S_I = a, S_T = b): which have s > 0, and s = a * b."""
    v = a * b
    ok = (a > tau_i) & (b > tau_t) & (v > 0)
    return (ok if dup is None else ok & (a <= dup) & (b <= dup)), v


def merge_pairs(best_s: torch.Tensor, best_j: torch.Tensor, r: torch.Tensor, j: torch.Tensor,
                v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's positive pairs (row-major, ``j`` ascending within a row) into the
    running top-k. Only those above a row's current k-th score can enter; once the top-k has
    filled they are few. While rows still fill (over 4 k entering), each row's best k of them
    first (a top-k of the padded block)."""
    enter = v > best_s[:, k - 1].clamp(min=0.0)[r]
    r, j, v = r[enter], j[enter], v[enter]
    if not len(r):
        return best_s, best_j
    count = torch.bincount(r, minlength=len(best_s))
    slot = torch.arange(len(r), device=r.device) - (torch.cumsum(count, 0) - count)[r]
    most = int(count.max())
    pv = torch.full((len(best_s), most), -1.0, device=v.device)
    pj = torch.full((len(best_s), most), -1, dtype=torch.long, device=v.device)
    pv[r, slot], pj[r, slot] = v, j
    if most > 4 * k:                   # ties at the k-th place keep the lower column
        t = stable_topk(pv, k)
        pv, pj = pv.gather(1, t), pj.gather(1, t)
    return merge_topk(best_s, best_j, pv, pj, k)


# --- exact HPM ------------------------------------------------------------------------------------
def exact_hpm(img, txt, k: int, tau_i: float, tau_t: float, dup: Optional[float] = 0.98,
              queries: Optional[np.ndarray] = None, block_size: int = 8192, query_block: int = 1024,
              device: str = "cpu") -> TopK:
    """Alg. 1 for the targets ``queries`` (row indices; default every row) against every row of
    ``img``/``txt`` ([N, d], L2-normalised), in blocks of query_block x block_size scores, so
    memory stays bounded whatever N is. On ``device`` (cpu or cuda), in float32."""
    n = len(img)
    I, T = as_tensor(img, device), as_tensor(txt, device)
    q_all = np.arange(n) if queries is None else np.asarray(queries, dtype=np.int64)
    out_j, out_s, out_sup = [], [], []
    with torch.no_grad():
        for q0 in range(0, len(q_all), query_block):
            qidx = torch.as_tensor(q_all[q0:q0 + query_block], device=device)
            Iq, Tq = I[qidx], T[qidx]
            nq = len(qidx)
            best_s = torch.full((nq, k), -1.0, device=device)
            best_j = torch.full((nq, k), -1, dtype=torch.long, device=device)
            support = torch.zeros(nq, dtype=torch.long, device=device)
            for b0 in range(0, n, block_size):
                b1 = min(n, b0 + block_size)
                own = ((qidx >= b0) & (qidx < b1)).nonzero().flatten()    # the targets
                r, c, v = positive_pairs(Iq @ I[b0:b1].T, Tq @ T[b0:b1].T, tau_i, tau_t, dup,
                                         own, qidx[own] - b0)
                support += torch.bincount(r, minlength=nq)
                best_s, best_j = merge_pairs(best_s, best_j, r, c + b0, v, k)
            j, s = _finish(best_s, best_j)
            out_j.append(j), out_s.append(s), out_sup.append(support.cpu().numpy())
    if not out_j:
        return TopK(np.zeros((0, k), np.int64), np.zeros((0, k), np.float32),
                    np.zeros(0, np.int64), np.zeros(0, bool))
    sup = np.concatenate(out_sup)
    return TopK(np.concatenate(out_j), np.concatenate(out_s), sup, np.ones(len(sup), bool))


# --- FastHPM: IVF-PQ over the joint vector ----------------------------------------------------------
@dataclass(frozen=True)
class IvfParams:
    nlist: int
    m: int
    nbits: int
    nprobe: int
    train_size: int
    hnsw: bool = False          # an HNSW coarse quantizer (auto: nlist >= 4096)


def _pow2(x: float) -> int:
    return 1 << max(0, int(round(math.log2(max(x, 1.0)))))


def auto_params(n: int, d: int, nlist: Optional[int] = None, m: Optional[int] = None,
                nbits: int = 4, nprobe: Optional[int] = None,
                train_size: Optional[int] = None) -> IvfParams:
    """IVF-PQ parameters for ``n`` vectors of dimension ``d``; each value given wins. Chosen from
    tests/benchmarks/bench_mining.py (recall@50 of FastHPM against exact HPM, tau 0.3):

    * nlist: the power of two nearest sqrt(n), at most n / 39 (FAISS wants >= 39 training points
      per list): 256 at 65k, 1024 at 1M. Hard pairs are not close neighbours (their joint
      similarity is often 0.4-0.7), so recall depends on the fraction of lists probed more than
      on a fine partition, and fewer lists keep the coarse step and the training cheap;
    * nprobe: nlist / 16, at least 64 (25% of the lists at 65k, 6.25% at 1M): recall@50 0.995
      on the real-derived 65k set, 0.99 on the clustered 100k and 1M sets (k' = 4k); a target
      costs about nprobe x n / nlist x m / 32 SIMD lookups, the bulk of FastHPM's time;
    * m, nbits: 4-bit fast-scan codes (SIMD scanning) of d / 2 sub-quantizers (2 dimensions
      each; d bytes per vector): 4-dimension sub-quantizers lose ~2-3 points of recall at equal k';
    * train_size: 64 points per list, at least 40 per PQ centroid, at most n (a pool smaller than
      2^nbits gets fewer bits per code).
    """
    if nlist is None:
        nlist = max(1, min(_pow2(math.sqrt(n)), n // 39))
    if m is None:
        m = max(x for x in range(1, d + 1) if d % x == 0 and x <= max(1, d // 2))
    if d % m:
        raise ValueError(f"pq m={m} must divide the vector dimension {d}")
    if nprobe is None:
        nprobe = max(64, nlist // 16)
    if train_size is None:
        train_size = max(64 * nlist, 40 << nbits)
    train_size = min(n, train_size)
    while nbits > 1 and (1 << nbits) > train_size:     # a tiny pool: fewer PQ centroids
        nbits -= 1
    return IvfParams(nlist=nlist, m=m, nbits=nbits, nprobe=min(nprobe, nlist),
                     train_size=train_size, hnsw=nlist >= 4096)


def joint(img: np.ndarray, txt: np.ndarray) -> np.ndarray:
    """[I; T] / sqrt(2): for unit I, T its inner products are the mean of the two similarities."""
    return (np.concatenate([img, txt], axis=1) / np.float32(math.sqrt(2))).astype(np.float32)


def build_ivfpq(x, p: IvfParams, seed: int = 0, chunk: int = 65536):
    """An inner-product IVF-PQ index over ``x`` (an array, or a JointView), trained on a seeded
    sample of p.train_size rows. nbits = 4 selects FAISS's fast-scan layout (SIMD code scanning).
    With p.hnsw the trained centroids are put in an HNSW graph, so a query finds its nprobe lists
    without comparing itself to all nlist centroids (built on one thread: deterministic)."""
    import faiss
    d = x.shape[1]
    quantizer = faiss.IndexFlatIP(d)
    if p.nbits == 4 and p.m % 2 == 0:
        index = faiss.IndexIVFPQFastScan(quantizer, d, p.nlist, p.m, 4, faiss.METRIC_INNER_PRODUCT)
    else:
        index = faiss.IndexIVFPQ(quantizer, d, p.nlist, p.m, p.nbits, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.cp.min_points_per_centroid = 1      # small pools: no FAISS warnings, same result
    index.pq.cp.seed = seed + 1
    index.pq.cp.min_points_per_centroid = 1
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(len(x), size=p.train_size, replace=False))
    index.train(np.ascontiguousarray(x[sample]))
    if p.hnsw:
        hq = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        try:
            hq.add(quantizer.reconstruct_n(0, p.nlist))
        finally:
            faiss.omp_set_num_threads(threads)
        index.quantizer = hq
        index.referenced_objects = [quantizer, hq]   # keep them alive beside the index
    for c0 in range(0, len(x), chunk):
        index.add(np.ascontiguousarray(x[c0:c0 + chunk], dtype=np.float32))
    set_nprobe(index, p.nprobe)
    return index


def set_nprobe(index, nprobe: int) -> None:
    """nprobe, and an HNSW coarse quantizer's search breadth to match."""
    import faiss
    index.nprobe = nprobe
    try:
        q = faiss.downcast_index(faiss.extract_index_ivf(index).quantizer)
    except (RuntimeError, AttributeError):         # a GPU index
        return
    if isinstance(q, faiss.IndexHNSW):
        q.hnsw.efSearch = max(2 * nprobe, 64)


def index_to_device(index, device: str):
    """The GPU copy of a FAISS index when faiss has GPU support and a GPU is in use. FAISS has no
    GPU version of every index (fast-scan PQ among them): those stay on the CPU, with a warning,
    and only the torch re-scoring runs on the GPU (set hpm.fast.pq_nbits to 8 for a GPU index)."""
    if device != "cuda" or not faiss_gpu_available():
        return index
    import faiss
    res = faiss.StandardGpuResources()
    co = faiss.GpuClonerOptions()
    co.useFloat16 = True           # lookup tables for large m
    try:
        gpu = faiss.index_cpu_to_gpu(res, torch.cuda.current_device(), index, co)
    except RuntimeError as e:
        warnings.warn(f"FAISS cannot move this index to the GPU ({e}); it is searched on the CPU")
        return index
    gpu.referenced_resources = res  # keep it alive with the index
    return gpu


def sample_pool(n: int, size: Optional[int], seed: int) -> np.ndarray:
    """HELIP's uniform candidate pool (Alg. 2): ``size`` rows of ``n`` without replacement,
    seeded, sorted; every row when size is None or >= n."""
    if size is None or size >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False)).astype(np.int64)


def _nlist(index) -> int:
    import faiss
    try:
        return faiss.extract_index_ivf(index).nlist
    except (RuntimeError, AttributeError):       # a GPU index
        return index.getNumLists() if hasattr(index, "getNumLists") else index.nlist


def gather_dots(q: np.ndarray, base, ids: np.ndarray, device: str = "cpu") -> torch.Tensor:
    """out[a, b] = <q[a], base[ids[a, b]]> (-inf where ids is -1), without materialising the
    gathered rows on the CPU (FAISS's by-index inner products); torch gather + bmm on a GPU."""
    nq, kp = ids.shape
    if device == "cpu":
        import faiss
        q = np.ascontiguousarray(q, dtype=np.float32)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty((nq, kp), np.float32)
        faiss.fvec_inner_products_by_idx(faiss.swig_ptr(out), faiss.swig_ptr(q),
                                         faiss.swig_ptr(base), faiss.swig_ptr(ids),
                                         q.shape[1], nq, kp)
        return torch.from_numpy(out)
    it = torch.as_tensor(ids, device=device)
    rows = base.index_select(0, it.clamp(min=0).flatten()).view(nq, kp, -1)
    out = torch.bmm(rows, as_tensor(q, device).unsqueeze(2)).squeeze(2)
    return out.masked_fill_(it < 0, -math.inf)


class FastHPM:
    """FastHPM over a pool: the IVF-PQ index of its joint vectors, and its float vectors for the
    exact re-scoring. ``pool`` maps pool positions to global row indices."""

    def __init__(self, index, pool: np.ndarray, img_pool, txt_pool, device: str = "cpu") -> None:
        self.index = index
        self.pool = np.asarray(pool, dtype=np.int64)
        self.device = device
        if device == "cpu":      # FAISS reads them in place (a memmap stays shared)
            self.I = np.ascontiguousarray(img_pool, dtype=np.float32)
            self.T = np.ascontiguousarray(txt_pool, dtype=np.float32)
        else:
            self.I, self.T = as_tensor(img_pool, device), as_tensor(txt_pool, device)
        self.exhaustive = index.nprobe >= _nlist(index)

    @classmethod
    def build(cls, img: np.ndarray, txt: np.ndarray, params: IvfParams, pool: np.ndarray,
              seed: int = 0, device: str = "cpu") -> "FastHPM":
        every = len(pool) == len(img)           # the whole table: no copy of the vectors
        ip, tp = (img, txt) if every else (img[pool], txt[pool])
        index = build_ivfpq(JointView(ip, tp), params, seed)
        return cls(index_to_device(index, device), pool, ip, tp, device)

    def query(self, qi, qt, qidx: np.ndarray, k: int, tau_i: float, tau_t: float,
              dup: Optional[float] = 0.98, k_prime: Optional[int] = None,
              k_prime_max: Optional[int] = None, widen: str = "noise", block: int = 2048,
              margin: bool = True) -> TopK:
        """Top-k hard pairs of the targets (vectors qi, qt; global indices qidx) among the pool:
        k' candidates each (default 4 k), re-scored exactly. Uncertified targets are searched
        again with k' x 4 up to k_prime_max (default 4 k'): ``widen`` "noise" does it only for
        targets about to be called noise pairs (fewer than k supporters among the candidates,
        and more could lie beyond them: a row would be dropped on an estimate), "all" for every
        uncertified target, "off" never. ``margin``: widen the certificate's bound by the
        target's largest IVF-PQ underestimate among its candidates (see _block); False gives
        the plain m_k'^2 test."""
        qi = np.ascontiguousarray(qi, dtype=np.float32)
        qt = np.ascontiguousarray(qt, dtype=np.float32)
        qidx = np.asarray(qidx, dtype=np.int64)
        c = len(self.pool)
        kp = min(max(k_prime or 4 * k, k), c)
        kp_max = kp if widen == "off" else min(max(k_prime_max or WIDEN * kp, kp), c)
        nq = len(qidx)
        out = TopK(np.full((nq, k), -1, np.int64), np.zeros((nq, k), np.float32),
                   np.zeros(nq, np.int64), np.zeros(nq, bool))
        todo = np.arange(nq)
        while len(todo):
            for b0 in range(0, len(todo), block):
                rows = todo[b0:b0 + block]
                r = self._block(qi[rows], qt[rows], qidx[rows], kp, k, tau_i, tau_t, dup, margin)
                for f in ("idx", "score", "support", "certified"):
                    getattr(out, f)[rows] = getattr(r, f)
            if kp >= kp_max:
                break
            kp = min(kp * WIDEN, kp_max)
            again = ~out.certified[todo]
            if widen == "noise":
                again &= out.support[todo] < k
            todo = todo[again]
        return out

    def _block(self, qi, qt, qidx, kp, k, tau_i, tau_t, dup, margin) -> TopK:
        nq, dev = len(qidx), self.device
        D, L = self.index.search(joint(qi, qt), kp)             # L: pool positions, -1 = none
        valid = torch.as_tensor(L >= 0, device=dev)
        g = np.where(L >= 0, self.pool[np.maximum(L, 0)], -1)    # global indices
        si = gather_dots(qi, self.I, L, dev)
        st = gather_dots(qt, self.T, L, dev)
        m_exact = (si + st) / 2                                   # joint similarity, exact
        s = pair_scores(si.masked_fill_(~valid, 0), st.masked_fill_(~valid, 0), tau_i, tau_t, dup)
        s[torch.as_tensor(g == qidx[:, None], device=dev)] = 0.0  # the target itself
        support = (s > 0).sum(1)
        kk = min(k, kp)
        v, j = s.topk(kk, dim=1)
        best_s = torch.full((nq, k), -1.0, device=dev)
        best_j = torch.full((nq, k), -1, dtype=torch.long, device=dev)
        best_s[:, :kk] = v
        best_j[:, :kk] = torch.as_tensor(g, device=dev).gather(1, j)
        # the certificate: a pair not retrieved has joint similarity <= m_k' (the smallest the
        # search returned, an IVF-PQ estimate), so it scores at most bound(m_k'). The estimate
        # errs; with ``margin`` m_k' is raised by the target's largest underestimate among its
        # own candidates (exact m minus the estimate), the likely error of the pairs just below.
        Dt = torch.as_tensor(D, device=dev)
        m_last = torch.where(valid, Dt, torch.full_like(Dt, math.inf)).min(1).values
        if margin:
            under = torch.where(valid, m_exact - Dt, torch.zeros_like(Dt)).max(1).values
            m_last = m_last + under.clamp(min=0)
        bound = score_bound(m_last.clamp(max=1.0), tau_i, tau_t)
        complete = torch.zeros(nq, dtype=torch.bool, device=dev)
        if self.exhaustive:        # every list scanned: fewer results than asked = all of them
            complete = (~valid).any(1) | (kp >= len(self.pool))
        kth = best_s[:, k - 1]
        certified = complete | torch.where(support >= k, kth >= bound, bound <= 0)
        j, s = _finish(best_s, best_j)
        return TopK(j, s, support.cpu().numpy(), certified.cpu().numpy())


class JointView:
    """The joint vectors of (img, txt) rows, computed on access (no N x 2d copy)."""

    def __init__(self, img, txt) -> None:
        self.img, self.txt = img, txt
        self.shape = (len(img), img.shape[1] + txt.shape[1])

    def __len__(self) -> int:
        return len(self.img)

    def __getitem__(self, idx) -> np.ndarray:
        return joint(self.img[idx], self.txt[idx])


def save_index(index, path: str) -> None:
    import faiss
    faiss.write_index(index, path)


def load_index(path: str, nprobe: int, device: str = "cpu"):
    """Read a saved (CPU) index, set nprobe, and move it to the GPU when one is in use."""
    import faiss
    index = faiss.read_index(path)
    set_nprobe(index, nprobe)
    return index_to_device(index, device)
