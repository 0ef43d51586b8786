"""What runs inside Ray workers: reading a part, calling a stage, global steps, table reads.

Kept apart from runner.py so that a worker unpickling these functions imports only this module
and the stage it runs, not the whole DAG (every stage's heavy libraries) that runner.py imports.
"""
from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pyarrow as pa

from .parts import PartIO, StageCall, commit_empty, pinned_threads, read_inputs
from . import storage
from .rundir import StageDir


def _read_batch(batch: pa.Table, io: PartIO, schema: pa.Schema) -> pa.Table:
    out = []
    for row in batch.to_pylist():
        spec = json.loads(row["spec"]) if row["spec"] else None
        t = read_inputs(io, row["part"], spec, row["lo"], None if row["hi"] < 0 else row["hi"])
        if t.num_rows == 0:
            commit_empty(io, row["part"], schema)
        else:
            out.append(t)
    if not out:
        return t
    return pa.concat_tables(out) if len(out) > 1 else out[0]


_INSTANCES: dict = {}


def _stage_task(batch: pa.Table, stage_cls: type, config: Any, state_path: Optional[str]) -> pa.Table:
    """A light stage in a Ray task: one stage instance per worker process, reused across tasks."""
    key = (stage_cls, config, state_path)
    call = _INSTANCES.get(key)
    if call is None:
        _INSTANCES.clear()
        call = _INSTANCES[key] = _RayStageCall(stage_cls, config, state_path)
    return call(batch)


class _RayStageCall(StageCall):
    """Loads a global step's state from the run dir (not the object store), so that Ray can
    restart a lost actor on any node that sees the run dir."""

    def __init__(self, stage_cls: type, config: Any, state_path: Optional[str] = None) -> None:
        state = None
        if state_path:
            state = pickle.loads(storage.read_bytes(state_path))
        super().__init__(stage_cls, config, state)


def _apply(fn: Callable, x: Any, threads: int = 1) -> Any:
    with pinned_threads(threads):
        return fn(x)


def _prepare(stage: type, config: Any, io: PartIO, n_parts: int, workdir: str) -> Any:
    """A stage's global step, with the same fixed thread count wherever it runs."""
    def read(part: int) -> pa.Table:
        t = read_inputs(io, part)
        return t.filter(t.column("_active"))
    os.makedirs(workdir, exist_ok=True)
    with pinned_threads(config.run.intra_op_threads):
        return stage.prepare(config, read, n_parts, workdir)


@dataclass(frozen=True)
class TableReader:
    """Picklable reader of committed parts: (stage, part, columns) -> table."""
    run_dir: str
    roots: tuple[tuple[str, str], ...] = ()

    def __call__(self, stage: str, part: int, columns: Optional[list[str]] = None) -> pa.Table:
        return StageDir(self.run_dir, stage, dict(self.roots).get(stage)).read(part, columns)
