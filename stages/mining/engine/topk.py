"""Each row's best k scored pairs as pieces arrive (``Best``), the exact cut to a row's k-th
value (``at_or_above_kth``) and the canonical order of a top-k list: best score first, equal
scores by the lower global row (exact HPM's tie rule)."""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import native
from .core import COMPACT_SLACK


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
    the tie rule, so cutting to it first is exact: a dense [rows, run length] top-k, ~20x
    cheaper than sorting a dense block's pairs (the demo's random encoders: ~6,000 per row);
    on a CPU a quickselect per run in C (native.at_or_above_kth: the same mask, ~1/10 of the
    time)."""
    got = native.at_or_above_kth(r, v, k) if len(r) else None
    if got is not None:
        return got
    _, row, count = torch.unique_consecutive(r, return_inverse=True, return_counts=True)
    keep = torch.ones(len(r), dtype=torch.bool, device=r.device)
    if not len(r) or int(count.max()) <= k:
        return keep
    start = torch.cumsum(count, 0) - count
    v = torch.nan_to_num(v.float(), nan=-math.inf)
    big = (count > k).nonzero().flatten()          # only rows over k need a k-th value
    # rows by their count's power of 2: each dense piece at most 2x its entries (a long tail
    # of runs made one [rows, longest run] piece ~6x the entries of web-like data's positives)
    width = torch.pow(2, torch.ceil(torch.log2(count[big].double()))).long()
    for w in torch.unique(width).tolist():
        _cut(keep, r, v, k, start, count, big[width == w], int(w))
    return keep


def _cut(keep: torch.Tensor, r: torch.Tensor, v: torch.Tensor, k: int, start: torch.Tensor,
         count: torch.Tensor, big: torch.Tensor, width: int) -> None:
    """at_or_above_kth for the runs ``big`` (each of at most ``width`` entries), in place."""
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


def canonical(j: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row best first, equal scores by ascending global row (padding last): the order does
    not depend on the layout, the units or the block shapes. Returns (rows, permutation)."""
    key = np.where(j >= 0, j, np.iinfo(np.int64).max)
    perm = np.lexsort((key, -s), axis=1) if len(j) else np.zeros(j.shape, np.int64)
    return np.take_along_axis(j, perm, 1), perm
