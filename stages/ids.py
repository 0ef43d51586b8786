"""Duplicate ids: a global step over the whole ingest table.

Two records whose (source, key) collide get the same ``sample_id``; the first in part/row order
is kept and every later one is flagged ``ingest.duplicate_id`` with the position of the first.
"""
from __future__ import annotations

from typing import Any, Callable

import pyarrow as pa

from vlcurate.schemas import F, tables
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import GlobalStage, Resources, reasons_array


def find_duplicates(read: Callable[[int], pa.Table], n_parts: int) -> dict[int, dict[int, str]]:
    """{part: {row: detail}} for every row whose sample_id appeared earlier."""
    first: dict[str, tuple[int, int]] = {}
    dups: dict[int, dict[int, str]] = {}
    for part in range(n_parts):
        t = read(part)
        for sid, row in zip(t.column(F.SAMPLE_ID.name).to_pylist(), t.column(F.ROW.name).to_pylist()):
            if sid in first:
                p0, r0 = first[sid]
                dups.setdefault(part, {})[row] = f"same sample_id as part {p0} row {r0}"
            else:
                first[sid] = (part, row)
    return dups


class IdsStage(GlobalStage):
    name = "ids"
    inputs = {"ingest": (F.SAMPLE_ID,)}
    output = tables.IDS
    resources = Resources(num_cpus=0.25, batch_size=0)
    wants_position = True

    @classmethod
    def prepare(cls, cfg: Any, read: Callable[[int], pa.Table], n_parts: int, workdir: str) -> Any:
        return find_duplicates(read, n_parts)

    def __call__(self, batch: pa.Table) -> pa.Table:
        dups = self.state or {}
        parts = batch.column(F.PART.name).to_pylist()
        rows = batch.column(F.ROW.name).to_pylist()
        details = [dups.get(p, {}).get(r) for p, r in zip(parts, rows)]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         F.REASONS.name: reasons_array([[R.DUPLICATE_ID] if d else [] for d in details]),
                         F.REASON_DETAIL.name: pa.array(details, pa.string())},
                        schema=self.output)
