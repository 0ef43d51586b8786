"""The stage contract. A stage never imports ray; only ``pipeline/`` turns it into Ray calls.

A stage is a class of one of four kinds; the runner dispatches on ``kind``, never by probing for
attributes, and every method below has a do-nothing default unless its kind requires it:

=========  ===================================================================================
kind       what the runner does with it
=========  ===================================================================================
source     ``plan(cfg, plan_uri) -> [spec]`` on the driver (one spec per part), then per part
           ``read_part(cfg, spec) -> raw table`` and ``__call__``. ``signature(cfg)`` says when
           the source changed (it enters the fingerprint). The DAG starts with one source.
map        ``__call__(batch) -> table`` per chunk of a part, on the rows still kept.
global     ``prepare(cfg, read, n_parts, workdir) -> state`` once over every part (in one Ray
           task), then ``__call__`` per chunk with that ``state``. A redone upstream part redoes
           all of it.
sink       ``__call__`` on every row (kept or not) with every upstream reason, then
           ``finalize`` writes the outputs (export's shards). ``has_prepare(cfg)`` may ask for
           a global step first, as a global stage has (export's keep_top_fraction).
=========  ===================================================================================

Lifecycle of an instance, on a worker: ``Stage(cfg, state, schema)`` is cheap (no model load:
the driver builds stages only to describe them), ``setup()`` loads models once per worker, then
``__call__`` per chunk. ``finalize(cfg, ctx)`` runs on the driver after every part committed.
Everything the driver needs (``output_schema``, ``input_columns``, ``notes``, ``environment``)
is a classmethod of ``cfg`` and must not load a model.

Parameters: a stage owns a frozen :class:`~vlcurate.foundation.params.Params` dataclass, its
config section (``Params``, keyed by ``name``; a stage may own more than one through
``sections``). It reads other stages' sections only when it names them in ``reads``. The
instance gets ``cfg``: a :class:`StageConfig` holding exactly those sections plus ``run``. The
run's config is composed from the DAG's stages (``pipeline/config.py``), and the sections a
stage owns or reads enter its fingerprint, except the fields it names in ``speed_only`` (and
``resources``), which change speed, never output.

The runner hands a stage only the rows that are still kept, one output row per input row in the
same order, and fills the rows it skipped with nulls. A filter flags a row by putting reason codes
in ``reasons``; it never drops rows.
"""
from __future__ import annotations

import enum
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, ClassVar, Iterator, Mapping, Optional, Sequence

import pyarrow as pa

from vlcurate.foundation.params import Params, Resources
from vlcurate.schemas import F

from .images import COMPUTED, once_per_image  # noqa: F401 - the stages' import


@dataclass(frozen=True)
class Finding:
    """One line of the preflight: what was found (``ok``), or a problem saying what to do."""
    ok: bool
    text: str


class Kind(str, enum.Enum):
    SOURCE = "source"
    MAP = "map"
    GLOBAL = "global"
    SINK = "sink"


@dataclass(frozen=True)
class NoParams(Params):
    """The section of a stage without parameters (it still has ``resources``)."""
    resources: Resources = Resources()


@dataclass(frozen=True)
class StageConfig:
    """What a stage instance sees of the run's config: ``run`` and the sections it owns or reads
    (``cfg.embed.k``), nothing else. Hashable and picklable (it travels to Ray workers)."""
    run: Any
    sections: tuple[tuple[str, Any], ...]

    def __getattr__(self, name: str) -> Any:
        for key, value in object.__getattribute__(self, "sections"):
            if key == name:
                return value
        raise AttributeError(f"this stage's config has no section {name!r} (it has "
                             f"{[k for k, _ in self.sections]}: declare it in the stage's `reads`)")

    def section(self, name: str) -> Any:
        return getattr(self, name)


class Stage:
    kind: ClassVar[Kind] = Kind.MAP
    name: ClassVar[str]
    version: ClassVar[str] = "1"         # bump when the output changes meaning: reruns the stage
    Params: ClassVar[type] = NoParams    # this stage's own config section (key: ``name``)
    # other stages' sections it reads: "embed" (the whole section) or "concepts.teacher" (one
    # field: only the fields named enter the stage's fingerprint)
    reads: ClassVar[tuple[str, ...]] = ()
    speed_only: ClassVar[tuple[str, ...]] = ()  # own fields that change speed, never output
    inputs: ClassVar[Mapping[str, tuple[pa.Field, ...]]] = {}
    output: ClassVar[Optional[pa.Schema]] = None   # None: see output_schema
    # defaults for what the config's `<section>.resources` leaves unset (foundation/params.py)
    resources: ClassVar[Resources] = Resources()
    # the stage needs the rows' positions (F.PART, F.ROW columns) in its input
    wants_position: ClassVar[bool] = False
    # setup() loads a model: run on an actor pool, one instance per actor (GPUs per actor from
    # resources). Otherwise the stage runs in Ray tasks fused with its read and write, one
    # instance per worker process (cheaper: no actor start-up, no hand-off between operators).
    on_actors: ClassVar[bool] = False
    all_rows: ClassVar[bool] = False       # see every row, not only the ones still kept
    all_reasons: ClassVar[bool] = False    # receive F.ALL_REASONS, every upstream stage's reasons
    # a call's chunk may span parts: chunk_rows consecutive rows of the input over all parts, in
    # (part, row) order (pipeline/executors spanning_items), for a stage whose cost per row falls
    # with the rows per call (hpm's mining); the parts are still committed one by one
    spans_parts: ClassVar[bool] = False
    # the result depends on the row's image alone (OCR, image embeddings, recaptions, the concept
    # teacher): the runner computes it on every row of an image group any of whose rows is still
    # kept (within a part), so every caption of that image gets it; the stage's reasons still
    # count only on the rows still kept
    per_image: ClassVar[bool] = False
    # it computes per image through once_per_image (stages/images.py), on F.IMAGE: an image
    # whose rows lie in several parts is computed once in the run, in the first of them
    # (pipeline/homes.py), and the run counts the images it computed
    image_homes: ClassVar[bool] = False

    # --- what the preflight and the guards know of the stage (pipeline/preflight.py, guards.py)
    # the models setup() loads, each (config key, model family, what messages call it): the
    # preflight locates each under the loading policy (never loads it) and checks its device
    model_specs: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    # other config keys naming a device the stage computes on (hpm's matmuls)
    device_keys: ClassVar[tuple[str, ...]] = ()
    # the share of the rows it saw that a filter is expected to flag, at most, on a clean set in
    # one language: above it (or run.warn_reject_fraction, when lower) the run warns; None: only
    # above run.warn_reject_fraction
    expected_reject: ClassVar[Optional[float]] = None
    # reason code (or fnmatch pattern) -> every setting that changes that decision: what a
    # warning or an empty export tells the user to check (an exact code wins over a pattern)
    knobs: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def sections(cls) -> dict[str, type]:
        """The config sections this stage owns: {key: Params class}."""
        return {cls.name: cls.Params}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "name" in cls.__dict__:
            for key, params in cls.sections().items():
                if params is not NoParams:
                    params.section = key

    # --- the driver's view: cheap, no model load --------------------------------------------
    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], cfg: Any) -> list[str]:
        """Names of the columns to read from ``upstream`` (whose table has ``schema``)."""
        return [f.name for f in cls.inputs.get(upstream, ())]

    @classmethod
    def output_schema(cls, upstream: Mapping[str, pa.Schema], cfg: Any) -> pa.Schema:
        if cls.output is None:
            raise NotImplementedError(f"{cls.__name__}: set `output` or override output_schema")
        return cls.output

    @classmethod
    def chunk_rows(cls, cfg: Any) -> int:
        """Rows per call (pipeline/parts.py StageCall), of one part unless the stage
        ``spans_parts``: ``run.chunk_rows``, unless the stage's own config sets a chunk of its
        own (a numerics key: in its fingerprint)."""
        return cfg.run.chunk_rows

    @classmethod
    def notes(cls, cfg: Any) -> list[str]:
        """Things the run summary must say plainly (random weights, parts skipped, ...)."""
        return []

    @classmethod
    def environment(cls, cfg: Any) -> dict:
        """What the output depends on beyond config (an installed pipeline's identity): it
        enters the fingerprint."""
        return {}

    @classmethod
    def preflight(cls, config: Any, stages: frozenset[str]) -> list["Finding"]:
        """What the stage needs beyond its models, checked on the driver before anything runs
        (``vlcurate check``): open a pipeline or a backend as ``setup`` would, check settings
        against the data. ``config`` is the run's whole config, ``stages`` the names in the run."""
        return []

    @classmethod
    def preprocess(cls, cfg: Any, table: pa.Table) -> pa.Table:
        """CPU work done in the tasks that read a part, ahead of the stage's actors (image
        decoding for a GPU encoder). It sees every row of the part, with ``F.ACTIVE``, and must
        leave inactive rows alone."""
        return table

    @classmethod
    def has_prepare(cls, cfg: Any) -> bool:
        """Whether the runner calls ``prepare`` before the parts: a global stage always; a sink
        when its config asks for a run-wide step (export's keep_top_fraction). Such a stage
        depends on every upstream part: one redone upstream part redoes all of it."""
        return cls.kind == Kind.GLOBAL

    @classmethod
    def finalize(cls, cfg: Any, ctx: Any) -> dict:
        """After every part is committed, on the driver: write run-level outputs; return what
        the run summary should show (``notes``, ``skipped``, counts)."""
        return {}

    # --- an instance, on a worker ------------------------------------------------------------
    def __init__(self, cfg: Any, state: Any = None, schema: Optional[pa.Schema] = None) -> None:
        self.config = cfg
        self.state = state
        self.schema = schema if schema is not None else self.output

    def setup(self) -> None:
        """Load models (once per worker, before the first call)."""

    def __call__(self, batch: pa.Table) -> pa.Table:  # pragma: no cover - interface
        raise NotImplementedError


class MapStage(Stage):
    kind = Kind.MAP


@dataclass(frozen=True)
class Prepared:
    """An upstream stage's global step as another stage finds it (``read.prepared(name)``): the
    state its ``prepare`` returned, and its files (``workdir.local``, fetched to this node; a
    worker on another node calls ``workdir.fetch()`` before it reads them)."""
    state: Any
    workdir: Any


class GlobalStage(Stage):
    kind = Kind.GLOBAL

    @classmethod
    def prepare(cls, cfg: Any, read: Callable[[int], pa.Table], n_parts: int,
                workdir: str) -> Any:
        """The global step: ``read(part)`` gives a part's still-kept rows (with ``F.PART`` and
        ``F.ROW``); ``read.map(fn, items)`` spreads work over tasks; ``read.prepared(name)``
        is an upstream global stage's state and files (a :class:`Prepared`: positives reads
        hpm's sorted vectors so); ``read.narrowed(names)``, the same reader of fewer columns. Its result is every instance's ``state``: keep it small (big
        things, an index say, go as files in ``workdir``, which every worker sees; return their
        paths)."""
        raise NotImplementedError


class SourceStage(Stage):
    kind = Kind.SOURCE

    @classmethod
    def plan(cls, cfg: Any, plan_uri: str) -> list[dict]:
        """One spec per part (the driver; ``plan_uri`` is where to keep a plan table)."""
        raise NotImplementedError

    @classmethod
    def read_part(cls, cfg: Any, spec: dict) -> pa.Table:
        raise NotImplementedError

    @classmethod
    def signature(cls, cfg: Any) -> Any:
        """What identifies the source's content (sizes, times): a change reruns the DAG."""
        raise NotImplementedError


class SinkStage(Stage):
    kind = Kind.SINK
    all_rows = True
    all_reasons = True


def opened(label: str, if_missing: str, open_it: Callable[[], str],
           errors: tuple[type, ...]) -> Finding:
    """A preflight finding for something a stage opens (a spaCy pipeline, an OCR backend): what
    ``open_it`` says it opened, or a problem unless the stage may skip it (``if_missing``)."""
    try:
        return Finding(True, f"{label}: {open_it()}")
    except errors as e:
        if if_missing == "skip":
            return Finding(True, f"{label}: not available, and {label.split('.')[0]}.if_missing "
                                 f"is skip: the run goes on without it ({getattr(e, 'short', e)})")
        return Finding(False, str(e))


def reasons_array(per_row: list[list[str]]) -> pa.Array:
    return pa.array(per_row, type=F.REASONS.type)


def decoded_batches(images: Sequence[bytes], decode: Callable[[bytes], Any], batch_size: int,
                    threads: int = 0) -> Iterator[tuple[int, list]]:
    """(offset, decoded batch) in order. With ``threads`` > 0 a pool decodes up to two batches
    ahead of the caller (memory: three batches, whatever the number of images), so decoding
    overlaps the model (on an H100 a one-thread decode held ViT-S/8 to 340 of its 1,100 img/s
    and the ViT-H/14 teacher to 360 of 935); the values are the same."""
    if threads <= 0:
        for lo in range(0, len(images), batch_size):
            yield lo, [decode(b) for b in images[lo:lo + batch_size]]
        return
    with ThreadPoolExecutor(threads) as pool:
        rest = iter(images)
        ahead = deque(pool.submit(decode, b) for b in islice(rest, 2 * batch_size))
        for lo in range(0, len(images), batch_size):
            batch = [ahead.popleft().result() for _ in range(min(batch_size, len(images) - lo))]
            ahead.extend(pool.submit(decode, b) for b in islice(rest, batch_size))
            yield lo, batch
