"""The stage contract. A stage never imports ray; only ``pipeline/`` turns it into Ray calls.

A stage is a plain class:

* heavy setup (model loads) in ``__init__(config, state=None)``;
* work in ``__call__(batch: pa.Table) -> pa.Table``, the callable-class contract of Ray Data's
  ``map_batches``, so a unit test calls it directly with no Ray;
* ``inputs``: the upstream stages and the columns it reads from each (schema fields);
* ``output``: the schema of the narrow table it writes (key, its columns, its decisions);
* ``resources``: its default Ray resources (config may override them).

The runner hands a stage only the rows that are still kept, one output row per input row in the
same order, and fills the rows it skipped with nulls. A filter flags a row by putting reason codes
in ``reasons``; it never drops rows.

Optional hooks (class attributes):

* ``heavy_init = True``: the stage loads a model in ``__init__``; it runs on an actor pool (one
  instance per actor, GPUs per actor from ``resources``). Otherwise it runs in Ray tasks fused
  with its read and write, one instance per worker process.
* ``prepare(config, read, n_parts, workdir) -> state``: a *global* step over the whole
  materialised upstream table (``read(part) -> pa.Table`` gives the still-kept rows of a part,
  with ``F.PART``/``F.ROW`` columns), run once as a Ray task before the parts; its result is every
  instance's ``state`` (keep it small: put big things, an index say, as files in ``workdir``, a
  folder under the stage's directory that every node sees, and return their paths).
* ``preprocess(config, table) -> table`` (staticmethod): CPU work done in the tasks that read a
  part, ahead of the stage's actors (image decoding for a GPU encoder); it sees every row of the
  part, with the ``_active`` column, and must leave inactive rows alone.
* ``finalize(config, ctx)``: runs once after every part is committed (export writes shards there).
* ``config_sections``: the config sections that shape the output; they enter the fingerprint
  (a section's ``resources`` never do).
* ``version``: bump it when the stage's output changes meaning, so existing runs recompute it.
* ``input_columns`` / ``output_schema`` (classmethods): for stages whose columns depend on the
  upstream schemas or on config (an embedding's dimension, say).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import pyarrow as pa

from vlcurate.schemas import F


@dataclass(frozen=True)
class Resources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    batch_size: Optional[int] = 0        # 0 = one whole part per call
    concurrency: Optional[int] = None    # actor pool size; None = as many as the CPUs allow


class Stage:
    name: ClassVar[str]
    version: ClassVar[str] = "1"         # bump when the output changes meaning: reruns the stage
    config_sections: ClassVar[tuple[str, ...]] = ()   # config sections that shape the output
    inputs: ClassVar[Mapping[str, tuple[pa.Field, ...]]] = {}
    output: ClassVar[pa.Schema]
    resources: ClassVar[Resources] = Resources()
    # the stage needs the rows' positions (F.PART, F.ROW columns) in its input
    wants_position: ClassVar[bool] = False
    # heavy setup in __init__ (a model load): run on an actor pool, one instance per actor.
    # Otherwise the stage runs in Ray tasks fused with its read and write, one instance per
    # worker process (cheaper: no actor start-up, no hand-off between operators).
    heavy_init: ClassVar[bool] = False

    all_rows: ClassVar[bool] = False       # see every row, not only the ones still kept (export)
    all_reasons: ClassVar[bool] = False    # receive F.ALL_REASONS, every upstream stage's reasons

    prepare: ClassVar[Optional[Callable[..., Any]]] = None
    finalize: ClassVar[Optional[Callable[..., Any]]] = None   # after all parts: (config, ctx)

    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], config: Any) -> list[str]:
        """Names of the columns to read from ``upstream`` (whose table has ``schema``)."""
        return [f.name for f in cls.inputs.get(upstream, ())]

    @classmethod
    def output_schema(cls, upstream: Mapping[str, pa.Schema], config: Any) -> pa.Schema:
        return cls.output

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        """Things the run summary must say plainly (random weights, parts skipped, ...)."""
        return []

    def __init__(self, config: Any, state: Any = None) -> None:
        self.config = config
        self.state = state

    def __call__(self, batch: pa.Table) -> pa.Table:  # pragma: no cover - interface
        raise NotImplementedError


def reasons_array(per_row: list[list[str]]) -> pa.Array:
    return pa.array(per_row, type=F.REASONS.type)


def passthrough_ids(batch: pa.Table) -> pa.Array:
    return batch.column(F.SAMPLE_ID.name)


def once_per_image(images: Sequence[bytes], compute: Callable[[list[bytes]], list]) -> list:
    """``compute`` on each distinct image once, fanned back out to every row that shows it: the
    rows of an image with several captions (COCO and Flickr give five) share one OCR pass, one
    embedding, one set of recaptions. Rows are grouped by their bytes (equal bytes, equal
    ``image_hash``), in order of first appearance, so the result depends only on the batch."""
    index: dict[bytes, int] = {}
    first = [index.setdefault(b, len(index)) for b in images]
    results = compute(list(index))
    if len(results) != len(index):
        raise RuntimeError(f"{len(results)} results for {len(index)} distinct images")
    return [results[i] for i in first]
