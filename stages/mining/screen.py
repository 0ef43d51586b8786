"""A block's pairs worth keeping, with exact fp32 similarities (issue 15: bf16 blocks with an
fp32 re-score).

For a block (queries x members) the pass needs only the pairs that can score (S_I > tau_I and
S_T > tau_T: Alg. 1) or that pass a candidate floor (blocks.FLOORS): well under 0.1% of the
pairs on real data (0.03% at 200k synthetic rows, 0.1% on the real-derived 65k; the demo's
random encoders are the dense exception). ``hpm.precision``:

* ``fp32``: the block's GEMMs in fp32; the pairs are read off them.
* ``bf16``: the GEMMs in bf16 (tensor cores on a GPU, AMX on recent Xeons: 6x the fp32 rate
  on this machine) screen the pairs with a proven margin, and only the pairs that pass are
  re-scored in fp32 (gathered dot products). For unit vectors rounded to bf16 (unit roundoff
  u = 2^-8), summed in fp32 over K dimensions and rounded to bf16 once more,
  |S~ - S| <= 2u + u^2 + K 2^-23 + 1.01 u; ``margin`` adds the re-score's own K 2^-24 and
  keeps 3.1 u + 2 K 2^-24. A pair is a candidate when its screened similarities are within
  that margin of a threshold, so no pair that passes in fp32 is missed (tested against fp32
  on pairs placed at the thresholds). A block (or a stack of small units, blocks.run_stack,
  decided as one) whose candidates are over DENSE_SHARE of its pairs is computed in fp32
  instead (re-scoring costs ~60x a GEMM's share per pair).

The results equal fp32's up to the last bits of the similarities (a dot product and a GEMM
round differently), which is why ``hpm.precision`` is a numerics key, in the fingerprint, like
run.chunk_rows. On CUDA, bf16 GEMMs accumulate in fp32
(allow_bf16_reduced_precision_reduction is turned off), which the margin assumes.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

LOW = {"bf16": (torch.bfloat16, 2.0 ** -8)}      # dtype, unit roundoff
DENSE_SHARE = 1 / 64
RESCORE_ROWS = 4096         # pairs re-scored at once (bounded memory)
# (similarity, query vector, member vector); the cross-modal ones need ximg/xtxt
PAIRS = (("sii", "img", "img"), ("stt", "txt", "txt"), ("sit", "ximg", "xtxt"),
         ("xii", "ximg", "ximg"), ("xtt", "xtxt", "xtxt"))


def margin(precision: str, dim: int) -> float:
    """The largest |screened - re-scored| similarity of unit vectors of ``dim`` dimensions."""
    if precision == "fp32":
        return 0.0
    u = LOW[precision][1]
    return 3.1 * u + 2 * dim * 2.0 ** -24


def low(x: dict, precision: str) -> dict:
    """The vectors of ``x`` in the screen's dtype (fp32: themselves)."""
    if precision == "fp32":
        return x
    if any(v is not None and v.is_cuda for v in x.values()):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    return {f: None if v is None else v.to(LOW[precision][0]) for f, v in x.items()}


def to_bits(x, precision: str):
    """float32 [n, d] -> the int16 bits of its ``precision`` (bf16) copy, for disk."""
    return torch.from_numpy(x).to(LOW[precision][0]).view(torch.int16).numpy()


def low_rows(x, rows: slice, device: str) -> torch.Tensor:
    """Rows of a low copy: a device tensor already, or int16 bits (a memmap)."""
    if isinstance(x, torch.Tensor):
        return x[rows]
    return torch.from_numpy(np.ascontiguousarray(x[rows])).view(torch.bfloat16).to(device)


SHAPE_STEP = 128     # a low-precision GEMM's rows, padded to a multiple (see sims)


def _padded(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, -x.shape[-2] % SHAPE_STEP))


def sims(q: dict, m: dict) -> dict:
    """Every similarity of a block: queries q [nq, d] x members m [nm, d], per PAIRS (fp32
    results). A low precision's GEMM runs on operands padded
    to SHAPE_STEP rows: on a CPU, oneDNN builds a kernel per new shape (~5x the GEMM itself:
    clusters and query counts all differ), and padded shapes are few and cached. The padding
    only screens (every value the pass keeps is re-scored), so it changes no output."""
    out = {}
    for s, a, b in PAIRS:
        if q.get(a) is not None:
            x, y = q[a], m[b]
            if x.dtype != torch.float32:
                x, y = _padded(x), _padded(y)
            nq, nm = q[a].shape[-2], m[b].shape[-2]
            out[s] = (x @ y.transpose(-1, -2))[..., :nq, :nm].float()
    return out


def rescore(q: dict, m: dict, r: torch.Tensor, c: torch.Tensor) -> dict:
    """The exact fp32 similarities of the listed pairs (query r, member c)."""
    pairs = [(s, a, b) for s, a, b in PAIRS if q.get(a) is not None]
    out: dict = {s: [torch.zeros(0, device=r.device)] for s, _, _ in pairs}
    for i in range(0, len(r), RESCORE_ROWS):
        rr, cc = r[i:i + RESCORE_ROWS], c[i:i + RESCORE_ROWS]
        for s, a, b in pairs:
            out[s].append((q[a][rr] * m[b][cc]).sum(1))
    return {s: torch.cat(v) for s, v in out.items()}


GUARD = 1e-6       # the pre-screen's thresholds sit this far below the exact ones (a superset)


def _lowest(floors: dict, tau_i: float, tau_t: float) -> dict:
    """Each similarity's lowest threshold over the candidate rule (a pair it lists is above
    at least one of them)."""
    low = {n: f for n, f in floors.items()}
    low["sii"], low["stt"] = min(tau_i, low.get("sii", 2.0)), min(tau_t, low.get("stt", 2.0))
    return low


def _above_any(s: dict, low: dict, eps: float) -> torch.Tensor:
    """Flat (row-major) indices, ascending, of the block's pairs with any similarity above its
    ``low`` threshold less eps and GUARD. On a CPU through NumPy: its comparison and
    flatnonzero are ~3x torch's there, and this is the one pass over the whole block."""
    names = [n for n in s if n in low]
    if s[names[0]].device.type != "cpu":
        keep = s[names[0]] > low[names[0]] - eps - GUARD
        for n in names[1:]:
            keep.logical_or_(s[n] > low[n] - eps - GUARD)
        return keep.reshape(-1).nonzero().squeeze(1)
    keep = np.greater(s[names[0]].numpy(), low[names[0]] - eps - GUARD)
    for n in names[1:]:
        np.logical_or(keep, np.greater(s[n].numpy(), low[n] - eps - GUARD), out=keep)
    return torch.from_numpy(np.flatnonzero(keep))


def flat_candidates(s: dict, floors: dict, tau_i: float, tau_t: float, eps: float,
                    own: torch.Tensor) -> torch.Tensor:
    """Flat indices (ascending) of the pairs that may score (both similarities above their
    thresholds) or pass a floor, within ``eps``; the flat indices ``own`` (the targets
    themselves) left out. A pre-screen lists the few pairs above any threshold (under 1% on
    real data), and the rule is applied to those alone: the same pairs as the rule over the
    whole block, at a fraction of the passes."""
    flat = _above_any(s, _lowest(floors, tau_i, tau_t), eps)
    v = {n: x.reshape(-1)[flat] for n, x in s.items()}
    keep = (v["sii"] > tau_i - eps).logical_and_(v["stt"] > tau_t - eps)
    for name, floor in floors.items():
        if name in v:
            keep.logical_or_(v[name] > floor - eps)
    at = torch.searchsorted(flat, own).clamp_(max=max(len(flat) - 1, 0))   # flat is sorted
    if len(flat):
        keep[at[flat[at] == own]] = False
    return flat[keep]


def block_pairs(q: dict, q_low: dict, m: dict, m_low: Optional[dict], floors: dict,
                tau_i: float, tau_t: float, precision: str, own_r: torch.Tensor,
                own_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(rows, columns, exact similarities) of the block's candidate pairs: a superset of those
    that score or pass a floor, which the caller selects exactly. ``m_low``: the members' low
    copies when stored (else cast here)."""
    width = m["img"].shape[0]
    own = own_r * width + own_c
    flat, val = ragged_pairs(q, q_low, [(0, len(q["img"]), m, m_low)], floors, tau_i, tau_t,
                             precision, own)
    return flat // width, flat % width, val


def ragged_pairs(q: dict, q_low: dict, blocks: list, floors: dict, tau_i: float,
                 tau_t: float, precision: str, own: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Candidate pairs of several blocks at once: block b = (q0, q1, m, m_low) is queries
    q0:q1 x members m, laid out flat one block after the other, each row-major. One GEMM per
    block and similarity, written into one buffer; then one candidate pass over the buffer.
    Returns (flat indices, exact similarities); ``own``: the targets' own pairs, flat."""
    if precision != "fp32":
        s = flat_sims(q_low, [(a, b, mlow or low(m, precision)) for a, b, m, mlow in blocks])
        eps = margin(precision, max(v.shape[-1] for v in q.values() if v is not None))
        flat = flat_candidates(s, floors, tau_i, tau_t, eps, own)
        if len(flat) <= DENSE_SHARE * s["sii"].numel():
            return flat, rescore_flat(q, blocks, flat)
    s = flat_sims(q, [(a, b, m) for a, b, m, _ in blocks])
    flat = flat_candidates(s, floors, tau_i, tau_t, 0.0, own)
    return flat, {f: v[flat] for f, v in s.items()}


def offsets(blocks: list) -> np.ndarray:
    """Each block's first flat index (and the total)."""
    return np.cumsum([0] + [(b - a) * len(m["img"]) for a, b, m, *_ in blocks])


def flat_sims(q: dict, blocks: list) -> dict:
    """Every similarity of blocks (q0, q1, m), flat one after the other (``sims`` of each)."""
    if len(blocks) == 1:                   # one block: its own results, no copy
        a, b, m = blocks[0]
        return {n: x.reshape(-1) for n, x in
                sims({f: None if v is None else v[a:b] for f, v in q.items()}, m).items()}
    at = offsets(blocks)
    out = {}
    for u, (a, b, m) in enumerate(blocks):
        for name, x in sims({f: None if v is None else v[a:b] for f, v in q.items()}, m).items():
            if name not in out:
                out[name] = torch.empty(int(at[-1]), device=x.device)
            out[name][at[u]:at[u + 1]] = x.reshape(-1)
    return out


def rescore_flat(q: dict, blocks: list, flat: torch.Tensor) -> dict:
    """``rescore`` of flat pairs of blocks (q0, q1, m, ...): each pair's query and member."""
    at = offsets(blocks)
    cut = torch.searchsorted(flat, torch.as_tensor(at, device=flat.device)).tolist()
    out = [{s: torch.zeros(0, device=flat.device) for s, a, _ in PAIRS if q.get(a) is not None}]
    for u, (a, _, m, _) in enumerate(blocks):
        f = flat[cut[u]:cut[u + 1]] - int(at[u])          # flat is sorted: block u's pairs
        if len(f):
            w = len(m["img"])
            out.append(rescore(q, m, f // w + a, f % w))
    return {s: torch.cat([o[s] for o in out]) for s in out[0]}
