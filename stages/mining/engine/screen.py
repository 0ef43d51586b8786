"""A block's pairs worth keeping, with exact fp32 similarities (bf16 or int8 blocks
re-scored in fp32).

For a block (queries x members) the pass needs only the pairs that can score (S_I > tau_I and
S_T > tau_T: Alg. 1) or that pass a candidate floor (PassParams.floors): well under 0.1% of the
pairs on real data (0.03% at 200k synthetic rows, 0.1% on the real-derived 65k; the demo's
random encoders are the dense exception). ``hpm.engine.precision``:

* ``fp32``: the block's GEMMs in fp32; the pairs are read off them.
* ``bf16``: the GEMMs in bf16 (tensor cores on a GPU, AMX on recent Xeons: 6x the fp32 rate
  on this machine) screen the pairs with a proven margin, and only the pairs that pass are
  re-scored in fp32 (native.pair_dots: dot products in a fixed order, in C on a CPU). For
  unit vectors rounded to bf16 (unit roundoff u = 2^-8), summed in fp32 over K dimensions
  and rounded to bf16 once more, |S~ - S| <= 2u + u^2 + K 2^-23 + 1.01 u; ``margin`` adds
  the re-score's own K 2^-24 and keeps 3.1 u + 2 K 2^-24. A pair is a candidate when its
  screened similarities are within that margin of a threshold, so no pair that passes in
  fp32 is missed (tested against fp32 on pairs placed at the thresholds). A block (or a
  stack of small units, units.run_stack, decided as one) whose candidates are over
  DENSE_SHARE of its pairs is read off fp32 GEMMs instead (a re-scored pair costs many times
  a GEMM's share of it): ``dense_pairs``, only the blocks holding a candidate.
* ``int8``: the same with int8 GEMMs (exact integer sums, ~2x bf16's rate on CPUs with
  AVX512-VNNI or AMX and on GPUs) against per-row thresholds from a bound proven per row
  (q8.py); the layout's k-means and assignment, routing (each row's error bounded for the
  certificate) and the one-space searches (q8.hits) in int8 too. Its fp32 fallback starts at
  DENSE_SHARE x int8.precision.DENSE_GAIN (1/16) of a block's pairs.

The results equal fp32's up to the last bits of the similarities (a dot product and a GEMM
round differently), which is why ``hpm.engine.precision`` is a numerics key, in the fingerprint, like
run.chunk_rows. On CUDA, bf16 GEMMs accumulate in fp32
(allow_bf16_reduced_precision_reduction is turned off), which the margin assumes.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch

from .. import native
from ..hpm import as_tensor

DENSE_SHARE = 1 / 64
# (similarity, query vector, member vector); the cross-modal ones need ximg/xtxt
PAIRS = (("sii", "img", "img"), ("stt", "txt", "txt"), ("sit", "ximg", "xtxt"),
         ("xii", "ximg", "ximg"), ("xtt", "xtxt", "xtxt"))


def fp32_sums(x: Optional[torch.Tensor]) -> None:
    """Before a bf16 GEMM of x on CUDA: its sums in fp32 (no reduced-precision reduction),
    which every bf16 margin assumes."""
    if x is not None and x.is_cuda:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def low_rows(x, rows: slice, device: str, cluster: Optional[int] = None):
    """Rows of a low copy (a device tensor already, or int16 bits: a memmap), followed by the
    next rows of the copy up to a multiple of SHAPE_STEP where there are that many: ``sims``
    then pads nothing (a copy of the block), and reads only the first rows' results. A copy
    with its own ``block`` (int8's q8.Copy): its rows alone, with the scale and bounds of
    ``cluster``, the one the rows lie in (required: another cluster's would void the bound)."""
    if hasattr(x, "block"):
        return x.block(rows, cluster, device)
    stop = min(len(x), rows.stop + (rows.start - rows.stop) % SHAPE_STEP)
    if isinstance(x, torch.Tensor):
        return x[rows.start:stop]
    return as_tensor(x[rows.start:stop], device, torch.int16).view(torch.bfloat16)


SHAPE_STEP = 128     # a low-precision GEMM's rows, padded to a multiple (see sims)


def _padded(x: torch.Tensor, step: int = SHAPE_STEP) -> torch.Tensor:
    missing = -x.shape[-2] % step
    return torch.nn.functional.pad(x, (0, 0, 0, missing)) if missing else x


def sims(q: dict, m: dict, nm: Optional[int] = None, step: int = SHAPE_STEP) -> dict:
    """Every similarity of a block: queries q [nq, d] x members m [nm, d] (the first ``nm`` of
    m's rows when given: low_rows' spare rows are not members), per PAIRS, in the
    operands' dtype (a low precision's results stay low: the screen compares their bits, see
    _greater). A low precision's GEMM runs on operands padded to ``step`` rows: on a CPU,
    oneDNN builds a kernel per new shape (~5x the GEMM itself: clusters and query counts all
    differ), and padded shapes are few and cached. The padding only screens (every value the
    pass keeps is re-scored), so it changes no output; the results are views without it."""
    out = {}
    for s, a, b in PAIRS:
        if q.get(a) is not None:
            x, y = q[a], m[b]
            if x.dtype != torch.float32:
                x, y = _padded(x, step), _padded(y, step)
            out[s] = (x @ y.transpose(-1, -2))[..., :q[a].shape[-2], :nm or m[b].shape[-2]]
    return out


HIT_STEP = 32      # the one-space searches' low GEMMs: rows padded to a multiple of this


def hits(x: torch.Tensor, rows: np.ndarray, m: torch.Tensor, floor: float
         ) -> tuple[np.ndarray, np.ndarray]:
    """(query index into rows, member index) of the pairs <x[rows], m> > floor: one GEMM in the
    operands' dtype (a low one: both padded to HIT_STEP rows, so that a CPU's oneDNN meets few
    shapes and keeps their kernels; its results only screen, the caller lowers the floor by
    ``margin`` and accepts each hit on its fp32 dot product). A one-space unit has ~130 queries
    x a ~512-row cluster (1M rows, hpm.engine.pair_probe 8): padding to SHAPE_STEP would nearly
    double its queries."""
    q = x.index_select(0, torch.as_tensor(rows, device=x.device))
    return where(_greater(sims({"img": q}, {"img": m}, step=HIT_STEP)["sii"], floor))


def where(keep) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of a 2-d mask's true entries, row-major, as NumPy arrays (on a CPU from
    the flat indices: np.nonzero of a 2-d mask costs ~7x np.flatnonzero's, 30 against 4 us
    for 33 x 512)."""
    if isinstance(keep, np.ndarray):
        return np.divmod(np.flatnonzero(keep), keep.shape[1])
    return tuple(v.cpu().numpy() for v in keep.nonzero(as_tuple=True))


class QueryRows:
    """A block's query vectors: ``low``, gathered in the screen's precision (its GEMM operands),
    and the fp32 ones, rows ``index`` of ``base`` (a chunk's copy, units.Queries), gathered
    only where needed: the whole block for an fp32 GEMM (``full``); after a low screen, the
    re-score reads the pairs' rows of ``base`` (``rescore``), not a copy of every query."""

    def __init__(self, base: dict, index: torch.Tensor, low_: Optional[dict] = None) -> None:
        self.base, self.index = base, index
        self.low = self.full if low_ is None else low_

    @functools.cached_property
    def full(self) -> dict:
        return {x: None if v is None else v.index_select(0, self.index)
                for x, v in self.base.items()}

    def has(self, name: str) -> bool:
        return self.base.get(name) is not None

    @property
    def dim(self) -> int:
        return max(v.shape[-1] for v in self.base.values() if v is not None)

    def __len__(self) -> int:
        return len(self.index)


def rescore(q: QueryRows, m: dict, r: torch.Tensor, c: torch.Tensor) -> dict:
    """The exact fp32 similarities of the listed pairs (query r, member c): native.pair_dots
    (in C on a CPU, reading the rows in place; the same bits in torch elsewhere)."""
    rows = q.index.index_select(0, r)
    return {s: native.pair_dots(q.base[a], rows, m[b], c, r.device)
            for s, a, b in PAIRS if q.has(a)}


GUARD = 1e-6       # the pre-screen's thresholds sit this far below the exact ones (a superset)


@functools.lru_cache(maxsize=256)
def _bits_at_or_below(t: float) -> int:
    """The int16 bits of the largest bf16 value <= t (t > 0). For any bf16 v, v > t exactly
    when v's bits, read as int16, exceed these (positive floats order as their bits; negative
    ones, and NaN's sign-bit-set forms, read as negative ints)."""
    b = int(torch.tensor([t], dtype=torch.float32).to(torch.bfloat16).view(torch.int16))
    value = lambda bits: float(torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16))  # noqa
    while value(b) > t:
        b -= 1
    while value(b + 1) <= t:
        b += 1
    return b


def _greater(x: torch.Tensor, t: float):
    """x > t elementwise: a NumPy bool array on a CPU (NumPy's comparison is ~3x torch's there),
    a tensor elsewhere. A bf16 block with t > 0 (every real threshold) is compared by its int16
    bits, at half fp32's bytes and with no cast; the result is the same."""
    if x.dtype == torch.bfloat16 and t > 0:
        x, t = x.view(torch.int16), _bits_at_or_below(t)
    elif x.dtype != torch.float32:
        x = x.float()
    return np.greater(x.numpy(), t) if x.device.type == "cpu" else x > t


def _rule(s: dict, floors: dict, tau_i: float, tau_t: float, eps: float) -> torch.Tensor:
    """Flat (row-major) indices, ascending, of the block's pairs that pass the candidate rule
    with every threshold lowered by eps and GUARD: S_ii and S_tt both above tau, or any
    similarity above its floor. One elementwise pass per threshold over the whole block (2-d
    views read in place); it lists ~the candidates alone (0.2% of the pairs on the 1M
    synthetic set, against 3.5% above either tau), so what follows costs little."""
    keep = _greater(s["sii"], tau_i - eps - GUARD)
    cpu = isinstance(keep, np.ndarray)
    (np.logical_and if cpu else torch.logical_and)(
        keep, _greater(s["stt"], tau_t - eps - GUARD), out=keep)
    for name, floor in floors.items():
        if name in s:
            (np.logical_or if cpu else torch.logical_or)(
                keep, _greater(s[name], floor - eps - GUARD), out=keep)
    return torch.from_numpy(np.flatnonzero(keep)) if cpu else keep.reshape(-1).nonzero().squeeze(1)


def at_flat(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """x's values at row-major flat indices, as fp32 (x: 1-d, or a 2-d view read in place:
    torch.take indexes the logical shape, ~3x 2-d indexing)."""
    return torch.take(x, flat).float()


def flat_candidates(s: dict, floors: dict, tau_i: float, tau_t: float, eps: float,
                    own: torch.Tensor) -> torch.Tensor:
    """Flat indices (ascending) of the pairs that may score (both similarities above their
    thresholds) or pass a floor, within ``eps``; the flat indices ``own`` (the targets
    themselves) left out. The rule runs over the whole block a hair low (``_rule``: GUARD),
    then exactly on the few pairs it lists."""
    flat = _rule(s, floors, tau_i, tau_t, eps)
    v = {n: at_flat(x, flat) for n, x in s.items()}
    keep = (v["sii"] > tau_i - eps).logical_and_(v["stt"] > tau_t - eps)
    for name, floor in floors.items():
        if name in v:
            keep.logical_or_(v[name] > floor - eps)
    return _without(flat[keep], own)


def _without(flat: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Sorted flat indices without those in ``own`` (on a CPU by NumPy's mask, ~3x torch's
    boolean indexing of a dense screen's millions of candidates)."""
    if not len(flat) or not len(own):
        return flat
    at = torch.searchsorted(flat, own).clamp_(max=len(flat) - 1)
    at = at[flat[at] == own]
    if not len(at):
        return flat
    if flat.device.type == "cpu":
        keep = np.ones(len(flat), bool)
        keep[at.numpy()] = False
        return torch.from_numpy(flat.numpy()[keep])
    keep = torch.ones(len(flat), dtype=torch.bool, device=flat.device)
    keep[at] = False
    return flat[keep]


def block_pairs(q: QueryRows, m: dict, m_low: Optional[dict], floors: dict,
                tau_i: float, tau_t: float, precision, own_r: torch.Tensor,
                own_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(rows, columns, exact similarities) of the block's candidate pairs: a superset of those
    that score or pass a floor, which the caller selects exactly. ``m_low``: the members' low
    copies when stored (else cast here)."""
    own = own_r * m["img"].shape[0] + own_c
    return ragged_pairs(q, [(0, len(q), m, m_low)], floors, tau_i, tau_t, precision, own)


def ragged_pairs(q: QueryRows, blocks: list, floors: dict, tau_i: float, tau_t: float,
                 precision: Any, own: torch.Tensor, members: Optional[tuple] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Candidate pairs of several blocks at once: block b = (q0, q1, m, m_low) is queries
    q0:q1 x members m, laid out flat one block after the other, each row-major. One GEMM per
    block and similarity, written into one buffer; then one candidate pass over the buffer.
    Returns (query rows, member rows, exact similarities); ``own``: the targets' own pairs,
    flat; ``members``: (the vectors every block's members are rows of, by name, or None where
    nothing is re-scored; each block's first row in them), which the member rows count from
    (rescore_flat's); else a lone block's own rows. A low ``precision`` screens first
    (a precision.Precision: its screen); where it does not (fp32, or a dense block) the pairs are read off fp32
    GEMMs."""
    got = precision.screen(q, blocks, floors, tau_i, tau_t, own, members)
    if got is not None:
        return got
    s = flat_sims(q.full, [(a, b, m, len(m["img"])) for a, b, m, _ in blocks])
    flat = flat_candidates(s, floors, tau_i, tau_t, 0.0, own)
    r, c = pair_rows(blocks, flat, [0] * len(blocks) if members is None else members[1])
    return r, c, {f: at_flat(v, flat) for f, v in s.items()}


def dense_pairs(q: QueryRows, blocks: list, flat: torch.Tensor,
                members: Optional[tuple]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """ragged_pairs' answer, in fp32, for a screen too dense to re-score, given the screen's
    candidates ``flat`` (a proven superset: its margin holds for fp32 sums in any order; the
    targets' own pairs out): only the blocks holding a candidate are computed, each by the
    same GEMMs as ``flat_sims`` (the same bits), and read at its candidates alone. Like a
    re-scored screen it returns every candidate, which the caller selects exactly (Findings:
    the floors, Alg. 1's rule), so it keeps the same pairs with the same values as computing
    every block and every pair, without the GEMMs of blocks without a candidate, a copy of
    every block into one buffer and the rule's passes over all their pairs."""
    at = offsets(blocks)
    cut = torch.searchsorted(flat, torch.as_tensor(at, device=flat.device)).cpu().numpy()
    first = [0] * len(blocks) if members is None else members[1]
    rows, cols = torch.empty_like(flat), torch.empty_like(flat)
    got = {s: torch.empty(len(flat), device=flat.device, dtype=torch.float32)
           for s, a, _ in PAIRS if q.has(a)}
    for u in np.flatnonzero(cut[1:] > cut[:-1]):
        a, b, m, _ = blocks[u]
        nm, at_ = len(m["img"]), slice(cut[u], cut[u + 1])
        s = sims({f: None if v is None else v[a:b] for f, v in q.full.items()}, m, nm)
        here = {name: x[at_] for name, x in got.items()}
        if not native.dense_read(s, flat[at_], int(at[u]), a, int(first[u]), here,
                                 rows[at_], cols[at_]):
            local = flat[at_] - int(at[u])
            for name, x in s.items():
                torch.take(x, local, out=here[name])
            _row_col(local, nm, rows[at_], cols[at_])
            rows[at_] += a                               # pair_rows' rows and columns
            cols[at_] += int(first[u])
    return rows, cols, got


def _row_col(flat: torch.Tensor, width: int, row: torch.Tensor, col: torch.Tensor) -> None:
    """Row-major flat indices of a [*, width] block as (row, column), into row and col (NumPy's
    division by one integer on a CPU: ~5x torch's)."""
    if flat.device.type == "cpu":
        r, c = row.numpy(), col.numpy()
        np.floor_divide(flat.numpy(), width, out=r)
        np.subtract(flat.numpy(), r * width, out=c)
    else:
        torch.div(flat, width, rounding_mode="floor", out=row)
        torch.sub(flat, row * width, out=col)


def offsets(blocks: list) -> np.ndarray:
    """Each block's first flat index (and the total)."""
    return np.cumsum([0] + [(b - a) * len(m["img"]) for a, b, m, *_ in blocks])


def flat_sims(q: dict, blocks: list) -> dict:
    """Every similarity of blocks (q0, q1, m, nm), flat one after the other (``sims`` of each:
    queries q0:q1 x the first nm rows of m); one block: its own results (2-d, in place)."""
    def block(a, b, m, nm):
        return sims({f: None if v is None else v[a:b] for f, v in q.items()}, m, nm)
    if len(blocks) == 1:
        return block(*blocks[0])
    at = np.cumsum([0] + [(b - a) * nm for a, b, _, nm in blocks])
    out = {}
    for u, blk in enumerate(blocks):
        for name, x in block(*blk).items():
            if name not in out:
                out[name] = torch.empty(int(at[-1]), dtype=x.dtype, device=x.device)
            out[name][at[u]:at[u + 1]].view(x.shape).copy_(x)
    return out


def rescore_flat(q: QueryRows, blocks: list, flat: torch.Tensor,
                 members: Optional[tuple] = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(query rows, member rows, ``rescore``) of flat pairs of blocks (q0, q1, m, ...): each
    pair's query and member, from ``members`` (the vectors every block's members are rows of,
    by name, and each block's first row in them, which the member rows count from: run_stack's
    sorted vectors, one gather for a whole stack, ~a third of the time of one per unit), or a
    lone block's own members."""
    if members is None:
        if len(blocks) != 1:
            raise ValueError("several blocks are re-scored from the vectors their members are "
                             "rows of (members)")
        members = (blocks[0][2], [0])
    r, c = pair_rows(blocks, flat, members[1])
    return r, c, rescore(q, members[0], r, c)


def pair_rows(blocks: list, flat: torch.Tensor, first) -> tuple[torch.Tensor, torch.Tensor]:
    """(query row, member row) of flat pairs of blocks (q0, q1, m, ...), the member row counted
    from ``first`` (each block's first member's row in the vectors the caller reads)."""
    dev = flat.device
    at = torch.as_tensor(offsets(blocks), device=dev)
    u = torch.searchsorted(at, flat, right=True) - 1
    local = flat - at[u]
    width, q0, first = (torch.as_tensor(np.asarray(v, np.int64), device=dev) for v in (
        [len(m["img"]) for _, _, m, *_ in blocks], [a for a, *_ in blocks], first))
    return q0[u] + local // width[u], first[u] + local % width[u]
