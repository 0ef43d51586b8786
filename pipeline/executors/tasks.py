"""What runs inside Ray workers: reading a part, calling a stage, global steps, table reads.

Kept apart from the runner so that a worker unpickling these functions imports only this module
and the stage it runs, not the whole DAG (every stage's heavy libraries)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import pyarrow as pa

from vlcurate.schemas import F
from vlcurate.stages.base import Prepared

from vlcurate.foundation import storage
from vlcurate.foundation.heap import bounded_heap
from ..parts import PartIO, StageCall, pinned_threads, read_inputs, read_item, \
    write_fragments
from ..rundir import StageDir


ITEM = "item"       # the one column of a packed batch: one work item's table, as Arrow IPC


def pack(table: pa.Table) -> pa.Table:
    """One work item's table as one row, so that ``map_batches(batch_size=1)`` hands a stage
    exactly one work item, however Ray cuts or joins blocks (the schema and its metadata travel
    with the bytes)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    buf = sink.getvalue()
    offsets = pa.array([0, buf.size], pa.int64()).buffers()[1]
    return pa.table({ITEM: pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, buf])})


def unpack(batch: pa.Table) -> pa.Table:
    """The work item of a one-row batch made by :func:`pack`."""
    if batch.num_rows != 1:        # map_batches(batch_size=1): never more, never fewer
        raise RuntimeError(f"a packed batch holds one work item, not {batch.num_rows}")
    return pa.ipc.open_stream(batch.column(ITEM)[0].as_buffer()).read_all()


def read_batch(batch: pa.Table, io: PartIO) -> pa.Table:
    """The rows of a Ray batch, packed: one work item, its ranges as JSON."""
    (row,) = batch.to_pylist()              # every map_batches runs with batch_size=1
    ranges = json.loads(row["ranges"])
    specs = {ranges[0][0]: json.loads(row["spec"])} if row["spec"] else None
    return pack(read_item(io, ranges, specs))


def write_batch(batch: pa.Table, io: PartIO) -> pa.Table:
    return write_fragments(unpack(batch), io)


_INSTANCES: dict = {}


def stage_task(batch: pa.Table, stage_cls: type, cfg: Any, state_uri: Optional[str],
               schema: pa.Schema, workdir: Optional["Workdir"] = None) -> pa.Table:
    """A stage in a Ray task: one instance per worker process, reused across tasks."""
    key = (stage_cls, cfg, state_uri)
    call = _INSTANCES.get(key)
    if call is None:
        _INSTANCES.clear()
        call = _INSTANCES[key] = StageActor(stage_cls, cfg, state_uri, schema, workdir)
    return call(batch)


class StageActor(StageCall):
    """A stage on a worker: its global step's state is read from the run dir (not Ray's object
    store), so that Ray can restart a lost actor on any node that sees the run dir."""

    def __init__(self, stage_cls: type, cfg: Any, state_uri: Optional[str] = None,
                 schema: Optional[pa.Schema] = None, workdir: Optional[Workdir] = None) -> None:
        if workdir is not None:
            workdir.fetch()
        state = pickle.loads(storage.read_bytes(state_uri)) if state_uri else None
        super().__init__(stage_cls, cfg, state, schema)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return pack(super().__call__(unpack(batch)))


def apply(fn: Callable, x: Any, threads: int = 1) -> Any:
    with pinned_threads(threads):
        return fn(x)


@dataclass(frozen=True)
class Workdir:
    """A global step's files (an index, memmapped vectors): ``local``, a folder at the same path
    on every node that uses them, so the paths in the step's state hold everywhere. With a run
    directory on an object store, ``remote`` is their copy under the stage's folder: the node
    that ran the step publishes it, any other node fetches it once."""
    local: str
    remote: Optional[str] = None

    def fetch(self) -> str:
        done = os.path.join(self.local, ".complete")
        if self.remote and not os.path.exists(done):
            storage.download_dir(self.remote, self.local)
            open(done, "w").close()
        return self.local

    def publish(self) -> None:
        if self.remote:
            storage.upload_dir(self.local, self.remote)
            open(os.path.join(self.local, ".complete"), "w").close()


def workdir_for(root: str, attempt: str) -> Workdir:
    """``<root>/_prepare`` for a local run directory; for a remote one, a node-local scratch
    folder named after the stage's folder and its attempt (a new attempt never sees old files)."""
    if storage.is_local(root):
        return Workdir(os.path.join(storage.local_path(root), "_prepare"))
    key = hashlib.sha256(root.encode()).hexdigest()[:16]
    local = os.path.join(tempfile.gettempdir(), "vlcurate-scratch", key, attempt, "_prepare")
    return Workdir(local, storage.join(root, "_prepare"))


@dataclass(frozen=True)
class Upstream:
    """What a global step gets as ``read``: ``read(part)`` is a part's still-kept rows (with
    ``F.PART``/``F.ROW``); ``read.map(fn, items)`` runs ``fn`` over ``items`` in parallel (Ray
    tasks under the ray executor, so a step can spread its work: ids does); ``read.scratch``
    is a folder every such task sees (under the stage's folder: a URI on an object store);
    ``read.prepared(name)``, an upstream global stage's state and files (positives reads hpm's
    sorted vectors instead of collecting its own)."""
    io: PartIO
    parallel: str           # "ray" | "local"
    threads: int
    scratch: str
    steps: tuple = ()       # (name, state URI, Workdir) of each upstream global stage

    def prepared(self, name: str) -> Optional[Prepared]:
        """Upstream global stage ``name``'s Prepared; None when the DAG has none or its state is
        gone (a run directory from before states were kept, or files deleted by hand)."""
        for step, uri, workdir in self.steps:
            if step == name and storage.exists(uri):
                workdir.fetch()
                return Prepared(pickle.loads(storage.read_bytes(uri)), workdir)
        return None

    def narrowed(self, names: Iterable[str]) -> "Upstream":
        """The same reader with only the columns ``names`` of the stage's inputs (and always
        sample_id, the positions and, for a sink, every upstream reason)."""
        keep = set(names)
        cols = {u: [c for c in cs if c in keep] for u, cs in self.io.columns.items()}
        return dataclasses.replace(self, io=dataclasses.replace(self.io, columns=cols))

    def __call__(self, part: int) -> pa.Table:
        t = read_inputs(self.io, part)
        return t.filter(t.column(F.WANTED.name))

    def map(self, fn: Callable, items: list) -> list:
        if self.parallel != "ray":
            return [apply(fn, x, self.threads) for x in items]
        import ray      # inside the step's own task: Ray lends its CPU while it waits
        task = ray.remote(num_cpus=1)(apply)
        return ray.get([task.remote(fn, x, self.threads) for x in items])


def prepare_step(stage: type, cfg: Any, read: Upstream, n_parts: int, workdir: Workdir) -> Any:
    """A stage's global step, with the same fixed thread count wherever it runs."""
    if workdir.remote:
        shutil.rmtree(workdir.local, ignore_errors=True)
    os.makedirs(workdir.local, exist_ok=True)
    with bounded_heap(), pinned_threads(cfg.run.intra_op_threads):
        state = stage.prepare(cfg, read, n_parts, workdir.local)
    workdir.publish()
    return state


@dataclass(frozen=True)
class TableReader:
    """Picklable reader of committed parts: (stage, part, columns) -> table."""
    run_dir: str
    roots: tuple[tuple[str, str], ...] = ()

    def __call__(self, stage: str, part: int, columns: Optional[list[str]] = None) -> pa.Table:
        return StageDir(self.run_dir, stage, dict(self.roots).get(stage)).read(part, columns)
