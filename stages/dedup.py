"""Near-duplicate removal as a policy (stage ``dedup``, reason ``dedup.near_duplicate``).

The positives stage lists each row's near-duplicates (relation ``duplicate``: HELIP's S_ii or
S_tt above ``hpm.dup_threshold``; they are positives, never hard pairs). Here every group of rows
joined by such relations (connected components: a ~ b and b ~ c put a, b, c in one group) keeps
its first row in part/row order, and every other row gets ``dedup.near_duplicate`` with the
sample_id it duplicates. Like every filter this only annotates: ``export.drop`` decides.
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


def duplicate_groups(read: Callable[[int], pa.Table], n_parts: int) -> dict[str, str]:
    """{sample_id: the first sample_id of its group} for every row that is not its group's first,
    in part/row order (memory: the rows that have duplicates, not the dataset)."""
    order: dict[str, int] = {}
    parent: dict[str, str] = {}
    for part in range(n_parts):
        t = read(part)
        ids = t.column(F.SAMPLE_ID.name).to_pylist()
        for sid, pos, rels in zip(ids, t.column(MI.POSITIVE_IDS.name).to_pylist(),
                                  t.column(MI.POSITIVE_RELATIONS.name).to_pylist()):
            order.setdefault(sid, len(order))
            for other, rel in zip(pos or [], rels or []):
                if rel == MI.REL_DUPLICATE:
                    for x in (sid, other):
                        parent.setdefault(x, x)
                    a, b = _root(parent, sid), _root(parent, other)
                    if a != b:
                        parent[a] = b
    first: dict[str, str] = {}
    for sid in sorted(parent, key=lambda s: order.get(s, len(order))):
        first.setdefault(_root(parent, sid), sid)
    return {sid: first[_root(parent, sid)] for sid in parent
            if first[_root(parent, sid)] != sid and sid in order}


class DedupStage(GlobalStage):
    name = "dedup"
    version = "1"
    inputs = {"positives": (MI.POSITIVE_IDS, MI.POSITIVE_RELATIONS)}
    output = tables.stage_table()
    resources = Resources(num_cpus=0.25, batch_size=0)

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
