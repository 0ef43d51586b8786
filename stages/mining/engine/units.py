"""The units of work: cluster c and the queries routed to it (``run_unit``), or many small
units at once (``stacks``, ``run_stack``). A unit's blocks are screened in the pass's
precision (screen.py), its pairs kept with exact similarities (``Findings``: the top-k, the
support and the candidate pairs above the floors)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from .. import native
from ..hpm import positive_scores
from . import screen
from .core import COMPACT_SLACK, NAMES, SIMS, PassParams, Vectors, _rows, _take, _whole, no_pairs
from .layout import Layout
from .pairs import _above_floors, _cap, _on, _pairs
from .precision import get
from .topk import Best, at_or_above_kth


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
    prec = get(p.precision)
    base = None if not prec.rescores else \
        {x: _whole(getattr(vec, x)) for x in NAMES if q.has(x)}      # the re-score's
    r, member, val = screen.ragged_pairs(q, blocks, p.floors(), p.tau_i, p.tau_t, prec,
                                         torch.as_tensor(own, device=device), (base, a))
    acc = Findings(len(qall), p, device)
    acc.add(r, member, val, lay.order_on(device))
    return acc.result(q.index.cpu().numpy())


def empty_result(k: int, device="cpu") -> UnitResult:
    z = np.zeros(0, np.int64)
    return UnitResult(z, Best(0, k, device).lists(), z, no_pairs(), z)


class Queries:
    """A chunk's targets, gathered once from the N-row vectors and cast once to the screen's
    precision: a target is a query of ``probe`` units, which take its rows from here (a
    compact chunk x D copy) instead of gathering and casting them again from N rows."""

    def __init__(self, vec: Vectors, pos: np.ndarray, precision: str, device) -> None:
        self.pos, self.target = np.unique(pos, return_index=True)   # target: pos's index
        self.device = device
        self.full = {x: _take(getattr(vec, x), self.pos, device) for x in NAMES}
        self.low = get(precision).queries(self.full)

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
                                        get(p.precision), own, qpos[own] - s0)
        acc.add(r, to_row[cc + s0], val)
    return acc.result(q.index.cpu().numpy())


def _taken(mask: torch.Tensor, *xs: torch.Tensor) -> tuple:
    """Each of xs at the mask's true entries: one nonzero for all (a boolean index each
    searches the mask again)."""
    at = mask.nonzero().flatten()
    return tuple(x.index_select(0, at) for x in xs)


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

    def add(self, r: torch.Tensor, member: torch.Tensor, val: dict,
            to_row: Optional[torch.Tensor] = None) -> None:
        """A block's candidate pairs: rows r, members' global rows (or their sorted positions,
        mapped by ``to_row`` only where kept), exact similarities (one pass in C on a CPU,
        native.block_findings: the same pairs in the same order)."""
        got = native.block_findings(r, val, self.floors, self.p, self.support, self.cut)
        if got is None:
            new, top = self._select(r, member if to_row is None else to_row[member], val)
        else:
            kept, at, v = got
            mk, ma = member[kept], member[at]
            if to_row is not None:
                mk, ma = to_row[mk], to_row[ma]
            nan = torch.full((len(kept),), math.nan, device=r.device)
            new = [(r[kept], mk, *(val[f][kept] if f in val else nan for f in SIMS))
                   ] if len(kept) else []
            top = (r[at], ma, v)
        self._hold(new)
        self.best.add(*top)

    def _select(self, r: torch.Tensor, member: torch.Tensor, val: dict) -> tuple:
        """block_findings in torch: (the pairs kept above the floors, the positives among
        each row's best k), support counted."""
        p = self.p
        new = _above_floors(val, self.floors, r, member, p.max_pairs, self.cut)
        ok, v = positive_scores(val["sii"], val["stt"], p.tau_i, p.tau_t, p.dup)
        r, member, v = _taken(ok, r, member, v)
        self.support += torch.bincount(r, minlength=len(self.support))
        return new, _taken(at_or_above_kth(r, v, p.k), r, member, v)

    def _hold(self, new: list) -> None:
        p = self.p
        self.found, self.held = self.found + new, self.held + sum(len(x[0]) for x in new)
        if p.max_pairs is not None and self.held > 2 * len(self.cut) * p.max_pairs + COMPACT_SLACK:
            capped = _cap(_pairs(self.found), p.max_pairs, self.cut)
            self.found, self.held = [_on(capped, self.device)], len(capped["q"])

    def result(self, at: np.ndarray) -> UnitResult:
        """The rows' results, row i being the chunk's target at[i] (Queries.pos)."""
        pairs = _cap(_pairs(self.found), self.p.max_pairs, self.cut)
        pairs["q"] = at[pairs["q"]]
        return UnitResult(at, self.best.unsorted(), self.support.cpu().numpy(), pairs, self.cut)
