"""Where a stage's parts run: ``local`` (this process) or ``ray`` (Ray Data). Both take the same
:class:`Work` and hand every fragment record to the driver's ``Committer``: parts are committed
on the driver only, in both (a part that yielded no rows is committed empty there, after the
executor finishes). The per-part mechanics they share are in ``pipeline/parts.py``; what runs
inside a Ray worker is in ``tasks.py`` (kept free of the DAG's imports)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from ..parts import PartIO
from ..params import Resources


@dataclass(frozen=True)
class Work:
    """What one stage's parts need from an executor. ``items``: (part, lo, hi) row ranges, whole
    chunks (``batch_rows``, a multiple of ``run.chunk_rows``) of one part each; hi None = the
    part's end (a source part, whose size is known only once read). ``cfg`` is the stage's view
    of the config (``stages.base.StageConfig``), ``schema`` its output schema."""
    io: PartIO
    stage: type
    cfg: Any
    state: Any
    state_uri: Optional[str]          # where the pickled state is, for workers (Ray)
    workdir: Any                      # tasks.Workdir of a global step's files, or None
    res: Resources
    items: list[tuple[int, int, Optional[int]]]
    specs: Optional[list[dict]]
    schema: pa.Schema


def work_items(pending: list[int], sizes: Optional[dict[int, int]], rows: int
               ) -> list[tuple[int, int, Optional[int]]]:
    """Each pending part as row ranges of ``rows`` rows (0: one range per part)."""
    if sizes is None or not rows:
        return [(p, 0, None) for p in pending]
    return [(p, lo, min(lo + rows, sizes[p])) for p in pending
            for lo in range(0, max(sizes[p], 1), rows)]


def make(name: str, ray_config: Any, threads: int) -> Any:
    if name == "ray":
        from .ray import RayExecutor
        return RayExecutor(ray_config, threads)
    if name == "local":
        from .local import LocalExecutor
        return LocalExecutor(threads)
    raise ValueError(f"unknown executor {name!r}: use 'ray' or 'local'")
