"""Where a stage's parts run: ``local`` (this process) or ``ray`` (Ray Data). Both take the same
:class:`Work` and hand every fragment record to the driver's ``Committer``: parts are committed
on the driver only, in both (a part that yielded no rows is committed empty there, after the
executor finishes). The per-part mechanics they share are in ``pipeline/parts.py``; what runs
inside a Ray worker is in ``tasks.py`` (kept free of the DAG's imports)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa

from ..parts import PartIO
from vlcurate.foundation.params import Resources


Range = tuple[int, int, Optional[int]]      # (part, lo, hi): rows [lo, hi) of a part


@dataclass(frozen=True)
class Work:
    """What one stage's parts need from an executor. ``items``: the work, each item one batch of
    row ranges (``work_items``): whole chunks of one part, or for a stage that ``spans_parts``
    one chunk that may cover several parts; hi None = the part's end (a source part, whose size
    is known only once read). ``cfg`` is the stage's view of the config
    (``stages.base.StageConfig``), ``schema`` its output schema."""
    io: PartIO
    stage: type
    cfg: Any
    state: Any
    state_uri: Optional[str]          # where the pickled state is, for workers (Ray)
    workdir: Any                      # tasks.Workdir of a global step's files, or None
    res: Resources
    items: list[tuple[Range, ...]]
    specs: Optional[list[dict]]
    schema: pa.Schema


def work_items(pending: list[int], sizes: Optional[dict[int, int]], rows: int
               ) -> list[tuple[Range, ...]]:
    """Each pending part as row ranges of ``rows`` rows (0: one range per part), an item each."""
    if sizes is None or not rows:
        return [((p, 0, None),) for p in pending]
    return [((p, lo, min(lo + rows, sizes[p])),) for p in pending
            for lo in range(0, max(sizes[p], 1), rows)]


def spanning_items(pending: list[int], sizes: list[int], chunk: int) -> list[tuple[Range, ...]]:
    """A ``spans_parts`` stage's items: its input's rows over all parts in (part, row) order, cut
    every ``chunk`` rows, one item per chunk that holds a pending part's rows. The cuts depend
    on the part sizes alone (not on what is pending), so a resumed run calls the stage on the
    same chunks; a chunk's rows from parts already committed are read again, for context, and
    not written (``PartIO.done``)."""
    todo, start = set(pending), np.cumsum([0] + list(sizes))
    items = []
    for lo in range(0, int(start[-1]), chunk):
        hi = min(lo + chunk, int(start[-1]))
        first, last = np.searchsorted(start, [lo, hi - 1], side="right") - 1
        ranges = tuple((p, max(lo, int(start[p])) - int(start[p]),
                        min(hi, int(start[p + 1])) - int(start[p]))
                       for p in range(int(first), int(last) + 1) if sizes[p])
        if any(p in todo for p, _, _ in ranges):
            items.append(ranges)
    return items


def make(name: str, ray_config: Any, threads: int) -> Any:
    if name == "ray":
        from .ray import RayExecutor
        return RayExecutor(ray_config, threads)
    if name == "local":
        from .local import LocalExecutor
        return LocalExecutor(threads)
    raise ValueError(f"unknown executor {name!r}: use 'ray' or 'local'")
