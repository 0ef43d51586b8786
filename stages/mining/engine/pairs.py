"""Candidate pairs: those above a floor with every similarity (``_above_floors``), capped per
row at max_pairs by the highest of their similarities (``_cap``, ``Held``: exact, however
they arrive), and laid out as CSR (``csr``)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .core import COMPACT_SLACK, PAIR_FIELDS, SIMS, no_pairs
from .topk import at_or_above_kth


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


def csr(cat: dict, n: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Pairs (q in 0..n-1) as CSR, each row's sorted by j: (offsets, j, [each of SIMS])."""
    o = np.lexsort((cat["j"], cat["q"]))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(cat["q"], minlength=n), out=offsets[1:])
    return offsets, cat["j"][o], [cat[f][o] for f in SIMS]


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
