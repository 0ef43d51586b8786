"""Near-duplicate removal as a policy (stage ``dedup``, reason ``dedup.near_duplicate``).

The positives stage lists each row's near-duplicates (relation ``duplicate``: HELIP's S_ii or
S_tt above ``hpm.dup_threshold``; they are positives, never hard pairs). Dedup removes
near-duplicate *images* and exact repeats of a pair, never the other captions of one image
(``image_group``: they have S_ii = 1 but are data, not noise). Rows of different image groups
joined by such relations (connected components: a ~ b and b ~ c put a, b, c in one) keep the
rows of the component's first image group in part/row order; every other row of the component
gets ``dedup.near_duplicate`` with the sample_id it duplicates, as does a later row with the same
image and the same caption as an earlier one. Like every filter this only annotates:
``export.drop`` decides.
"""
from __future__ import annotations

from typing import Any, Callable

import pyarrow as pa

from vlcurate.schemas import F, conform
from vlcurate.schemas import mining as MI
from vlcurate.schemas import reasons as R
from vlcurate.schemas import tables
from vlcurate.stages.base import GlobalStage, Resources, reasons_array


def _root(parent: dict, x: str) -> str:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _edges(read: Callable[[int], pa.Table], n_parts: int) -> tuple[dict, list]:
    """({sample_id: part/row order} of every row, [(a, b)] duplicate relations)."""
    order: dict[str, int] = {}
    edges: list[tuple[str, str]] = []
    for part in range(n_parts):
        t = read(part)
        for sid, pos, rels in zip(t.column(F.SAMPLE_ID.name).to_pylist(),
                                  t.column(MI.POSITIVE_IDS.name).to_pylist(),
                                  t.column(MI.POSITIVE_RELATIONS.name).to_pylist()):
            order.setdefault(sid, len(order))
            edges += [(sid, o) for o, rel in zip(pos or [], rels or []) if rel == MI.REL_DUPLICATE]
    return order, edges


def _rows_of(read: Callable[[int], pa.Table], n_parts: int, want: set) -> dict[str, tuple]:
    """{sample_id: (image group, caption)} of the rows in ``want``."""
    out: dict[str, tuple] = {}
    for part in range(n_parts):
        t = read(part)
        for sid, g, cap in zip(t.column(F.SAMPLE_ID.name).to_pylist(),
                               t.column(F.IMAGE_GROUP.name).to_pylist(),
                               t.column(F.CAPTION.name).to_pylist()):
            if sid in want:
                out[sid] = (g if g is not None else sid, cap)
    return out


def duplicate_groups(read: Callable[[int], pa.Table], n_parts: int) -> dict[str, str]:
    """{sample_id: the row it duplicates} for every row dedup drops, in part/row order (memory:
    the rows that have duplicates, not the dataset).

    Rows of one image group (its other captions) are never near-duplicates of each other: only
    an exact repeat (the same image and the same caption) is, and it names the group's first
    such row. Across groups, rows joined by ``duplicate`` relations form connected components
    (a ~ b and b ~ c put a, b, c in one); each component keeps the rows of its first row's
    image group, and every other row names that first row."""
    order, edges = _edges(read, n_parts)
    rows = _rows_of(read, n_parts, {x for e in edges for x in e})
    parent: dict[str, str] = {}
    for a, b in edges:
        if a in rows and b in rows and rows[a][0] != rows[b][0]:
            for x in (a, b):
                parent.setdefault(x, x)
            ra, rb = _root(parent, a), _root(parent, b)
            if ra != rb:
                parent[ra] = rb
    first: dict[str, str] = {}
    for sid in sorted(parent, key=order.__getitem__):
        first.setdefault(_root(parent, sid), sid)
    out = {sid: first[_root(parent, sid)] for sid in parent
           if rows[sid][0] != rows[first[_root(parent, sid)]][0]}
    seen: dict[tuple, str] = {}          # (group, caption) -> its first row: exact repeats
    for sid in sorted(rows, key=lambda x: order.get(x, len(order))):
        out.setdefault(sid, seen.setdefault(rows[sid], sid))
        if out[sid] == sid:
            del out[sid]
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


class DedupStage(GlobalStage):
    name = "dedup"
    version = "2"   # the other captions of an image are never duplicates
    inputs = {"ingest": (F.CAPTION,), "ids": (F.IMAGE_GROUP,),
              "positives": (MI.POSITIVE_IDS, MI.POSITIVE_RELATIONS)}
    output = tables.stage_table()
    resources = Resources(num_cpus=0.25, batch_size=0)
    expected_reject = 0.30    # near-duplicates
    knobs = {R.DEDUP_NEAR: "hpm.dup_threshold (S_ii or S_tt above it is a duplicate), "
                           "positives.duplicates=false, or export.drop without "
                           "dedup.near_duplicate to export every copy"}

    @classmethod
    def prepare(cls, cfg: Any, read: Callable[[int], pa.Table], n_parts: int, workdir: str) -> Any:
        return duplicate_groups(read, n_parts)

    def __call__(self, batch: pa.Table) -> pa.Table:
        dup_of = self.state or {}
        ids = batch.column(F.SAMPLE_ID.name).to_pylist()
        return conform(pa.table({
            F.SAMPLE_ID.name: ids,
            F.REASONS.name: reasons_array([[R.DEDUP_NEAR] if s in dup_of else [] for s in ids]),
            F.REASON_DETAIL.name: pa.array([f"near-duplicate of {dup_of[s]}" if s in dup_of
                                            else None for s in ids], pa.string())}), self.output)
