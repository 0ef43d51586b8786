"""The local executor: the same stage objects and part functions, called in this process."""
from __future__ import annotations

from typing import Any, Callable

import pyarrow as pa

from ..parts import Committer, StageCall, batch_rows, read_inputs, read_item, write_fragments
from . import Work
from .tasks import apply


class LocalExecutor:
    name = "local"

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads

    def parts(self, w: Work, committer: Committer) -> None:
        call = StageCall(w.stage, w.cfg, w.state, w.schema)
        if w.stage.spans_parts:
            for item in w.items:
                self._commit(call(read_item(w.io, item)), w, committer)
            return
        rows = batch_rows(w.res.batch_size, w.stage.chunk_rows(w.cfg))
        for p in dict.fromkeys(item[0][0] for item in w.items):     # a part read once
            t = read_inputs(w.io, p, w.specs[p] if w.specs else None)
            if t.num_rows == 0:
                continue                 # committed empty by the driver (Committer.finish)
            step = rows or t.num_rows
            self._commit(pa.concat_tables([call(t.slice(lo, step))
                                           for lo in range(0, t.num_rows, step)],
                                          promote_options="default"), w, committer)

    @staticmethod
    def _commit(out: pa.Table, w: Work, committer: Committer) -> None:
        for rec in write_fragments(out, w.io).column("record").to_pylist():
            committer.add(rec)

    def call(self, fn: Callable, *args: Any, num_gpus: float = 0) -> Any:
        return fn(*args)

    def map(self, fn: Callable, items: list) -> list:
        return [apply(fn, x, self.threads) for x in items]
