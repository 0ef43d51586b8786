"""The run's configuration: typed, frozen, loaded from YAML (values only; the DAG lives in dag.py).

It is composed from the DAG: the run's own sections (``run``, ``ray``), each stage's sections
(its ``Params``, declared in the stage's file), and the trainer's (``finetune``). A plug-in
stage therefore brings its section with it: ``load(path, dag=my_dag)``. Every section is built
and checked the same way (``params.py``): an unknown key, a wrong type or a bad value is a
:class:`ConfigError` naming the dotted key, e.g. ``ingest.max_pixels: expected int, got 'lots'``.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional

import yaml

from .params import (ConfigError, FrozenMap, ModelSpec, Params, Resources, at_least, build,
                     positive, to_dict, to_json, unit, unknown_key)


@dataclass(frozen=True)
class RunConfig(Params):
    section: ClassVar[str] = "run"
    run_dir: str = "runs/default"        # a folder or a URI (s3://bucket/prefix, gs://...)
    # Heavy stages skip rows already flagged upstream (they get nulls). True computes every
    # ingested row, so that any later export policy finds its annotations.
    compute_on_flagged: bool = False
    progress: bool = True
    # run only these stages of the DAG (ingest and export always run); empty = all of them
    stages: tuple[str, ...] = ()
    # a stage that flags more than this share of the rows it saw prints a WARNING naming its top
    # reason and the setting to turn (console and summary)
    warn_reject_fraction: float = unit(0.9)   # each filter warns lower (its expected_reject)
    # ... and above this share the run stops after that stage (null: never stop)
    max_reject_fraction: Optional[float] = unit(None)
    # a run whose export keeps no row exits with code 2, naming the reasons; true: exit 0
    allow_empty: bool = False
    # per-image results computed image by image (OCR) are kept by image hash in a cache that
    # later runs reuse (stages/cache.py): a changed threshold, overlapping data or a second
    # dataset never recomputes an image already seen. Default folder: <run_dir>/_cache; point
    # several runs at one cache_dir (a path or URI) to share it. Changes speed, never output.
    image_cache: bool = True
    cache_dir: Optional[str] = None

    # Determinism (not resources): a stage is always called on chunks of chunk_rows rows of one
    # part, aligned to the part's first row (hpm: hpm.chunk_rows rows across parts, see
    # stages.base.Stage.spans_parts), whatever resources.batch_size (rounded up to a multiple
    # of it), the concurrency or the executor; and with intra_op_threads torch/BLAS/
    # OpenMP threads. Both change numerics at ~1e-7, so a non-default value enters fingerprints.
    chunk_rows: int = positive(1024)
    intra_op_threads: int = positive(1)


@dataclass(frozen=True)
class RayConfig(Params):
    section: ClassVar[str] = "ray"
    # None: $RAY_ADDRESS if set, else an embedded local Ray. "local" forces the embedded one.
    address: Optional[str] = None
    num_cpus: Optional[int] = positive(None)     # embedded Ray only
    num_gpus: Optional[int] = at_least(None, 0)  # embedded Ray only
    # Keep Ray's own per-operator progress bars (vlcurate prints one bar per stage anyway).
    ray_progress_bars: bool = False


@dataclass(frozen=True)
class FinetuneConfig(Params):
    """The thin DDP trainer over the exported shards (trainer/)."""
    section: ClassVar[str] = "finetune"
    shards: Optional[str] = None         # path or URI (s3://..); default: <run_dir>/export/shards
    out_dir: Optional[str] = None        # a path or URI; default: <run_dir>/finetune
    model: ModelSpec = ModelSpec(id="openai/clip-vit-base-patch32")
    loss: Literal["clip", "helip", "hn_nce", "sigmoid", "mp_nce"] = "clip"
    helip_seed_fraction: float = 0.5     # HELIP Alg. 3: the share of B used as seeds B'
    helip_p: int = 1                     # hard pairs drawn per seed (HELIP sec. 4.1: p = 1)
    helip_gamma: float = 1.0             # HNML weight (HELIP sec. 4.1: gamma = 1)
    hn_alpha: float = 1.0                # DiHT Table A.2 (LAION): alpha, beta = 1.0, 0.25
    hn_beta: float = 0.25
    fff_recaptions: int = 5              # recaptions per image added as positives (sigmoid/mp_nce)
    fff_mined_positives: bool = True     # the pipeline's FFF positives enter the mask M
    mp_views: int = 1                    # UniCLIP: augmented views per image (mp_nce only)
    mp_domain_weights: Optional[tuple[float, ...]] = None  # UniCLIP w_D [ii, it, tt]; null = N/#pairs per batch
    clipc_fraction: float = 0.0          # CLIP-C: share of composite samples per batch
    concept_weight: float = 0.0          # DiHT concept distillation (0.5 keeps the paper's balance)
    # train on kept rows that lack an annotation the loss reads (the export's manifest counts
    # them); false: refuse, naming the count and the setting
    allow_missing: bool = False
    n_objects: int = 0                   # concept head sizes (0: the run's vocabulary if concept_weight > 0)
    n_attributes: int = 0
    batch_size: int = 32                 # per rank
    steps: int = 100
    lr: float = 1e-5
    weight_decay: float = 0.1
    seed: int = 0
    ckpt_every: int = 50
    eval_fraction: float = 0.05          # share held out for zero-shot retrieval (by image-group hash)
    eval_seed: int = 0                   # seeds the held-out hash (apart from `seed`: same eval set)
    eval_batch_size: int = 64
    shuffle_buffer: int = 256
    bias_init_batches: int = 2           # FFF sec. 4.4: batches for the sigmoid bias search
    amp: bool = True                     # bf16 autocast on GPU
    nproc: int = 1                       # processes for `vlcurate finetune` (torchrun)
    progress: bool = True                # rank 0's progress bar (loss, samples/s)






# --- composition --------------------------------------------------------------------------------
RUN_SECTIONS: dict[str, type] = {"run": RunConfig, "ray": RayConfig}
PROGRAM_SECTIONS: dict[str, type] = {"finetune": FinetuneConfig}


def sections_of(dag: Any) -> dict[str, type]:
    """{section: Params class} for a DAG: the run's, each stage's own (in DAG order), the
    trainer's. Two stages may not own one section."""
    out = dict(RUN_SECTIONS)
    for node in dag:
        for key, params in node.stage.sections().items():
            if key in out and out[key] is not params:
                raise ConfigError(f"section {key!r} is owned twice (stage {node.name!r} and "
                                  "another): give the stage its own name")
            out[key] = params
    return {**out, **PROGRAM_SECTIONS}


class _Composed:
    """Methods of every composed Config class."""

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def replace(self, **overrides: Any) -> Any:
        """A copy with dotted-key overrides (``replace(**{"export.drop": []})``)."""
        data = to_dict(self)
        for k, v in overrides.items():
            _set_dotted(data, k, v)
        return _build_config(type(self), data)

    def __reduce__(self) -> Any:   # a composed class is rebuilt from its sections when unpickled
        return (_unpickle, (tuple(self._sections.items()), to_dict(self)))


@functools.lru_cache(maxsize=32)
def compose(sections: tuple[tuple[str, type], ...]) -> type:
    """The frozen Config dataclass with these sections, each defaulting to its Params()."""
    cls = dataclasses.make_dataclass(
        "Config", [(k, t, field(default_factory=t)) for k, t in sections],
        bases=(_Composed,), frozen=True, namespace={"_sections": dict(sections)})
    cls.__module__ = __name__
    return cls


def config_class(dag: Any = None) -> type:
    """The Config class of the default DAG plus ``dag``'s stages (so a config file written for
    the default pipeline loads unchanged with a DAG that adds a plug-in stage)."""
    from .dag import default_dag
    nodes = default_dag()
    names = {n.name for n in nodes}
    nodes += [n for n in dag or () if n.name not in names]
    return compose(tuple(sections_of(nodes).items()))


def _unpickle(sections: tuple, data: dict) -> Any:
    return _build_config(compose(sections), data)


def _build_config(cls: type, data: dict) -> Any:
    known = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in known:
            raise unknown_key(str(k), k, known)
    return build(cls, data, "")


def speed_only(dag: Any = None) -> dict[str, tuple[str, ...]]:
    """{section: its fields that change speed, never output} (left out of every fingerprint,
    like each section's ``resources``), from the stages that own them."""
    from .dag import default_dag
    return {n.name: tuple(n.stage.speed_only) for n in [*default_dag(), *(dag or ())]
            if n.stage.speed_only}


def default() -> Any:
    return config_class()()


def from_dict(data: dict | None, dag: Any = None) -> Any:
    return _build_config(config_class(dag), data or {})


def from_snapshot(data: dict, dag: Any = None) -> Any:
    """The config a run recorded in its run.json, read as it ran. A model spec with both
    ``random_init`` and a ``path`` ran with random weights before such a spec became an error:
    its path is dropped here, so that old run directories still export and train."""
    return from_dict(_ignored_paths_dropped(copy.deepcopy(data)), dag)


def _ignored_paths_dropped(d: Any) -> Any:
    if isinstance(d, dict):
        if d.get("random_init") is True and d.get("path"):
            d["path"] = None
        for v in d.values():
            _ignored_paths_dropped(v)
    elif isinstance(d, list):
        for v in d:
            _ignored_paths_dropped(v)
    return d


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = data
    for i, p in enumerate(parts[:-1]):
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: is not a section, cannot set {dotted}")
        cur = nxt
    cur[parts[-1]] = value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["export.drop=[cat.*]", "run.run_dir=/tmp/x"]`` -> {dotted key: YAML-parsed value}."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = yaml.safe_load(v) if v.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {k}: cannot parse {v!r}: {e}")
    return out


def _read_yaml(p: Path) -> dict:
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections")
    _sources_list(data)
    # a relative source path is relative to the config file's folder (run_dir: to the cwd)
    src = data.get("source")
    for s in [src, *(src.get("also") or [])] if isinstance(src, dict) else []:
        val = s.get("path") if isinstance(s, dict) else None
        if isinstance(val, str) and val and not Path(val).is_absolute() and "://" not in val:
            s["path"] = str((p.parent / val).resolve())
    return data


def _sources_list(data: dict) -> None:
    """A top-level ``sources: [a, b, ...]`` is ``source: a`` with ``also: [b, ...]``."""
    if "sources" not in data:
        return
    items = data.pop("sources")
    if "source" in data:
        raise ConfigError("sources: give either `source` (one, with `also` for more) or a "
                          "`sources` list, not both")
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise ConfigError(f"sources: expected a non-empty list of source sections, got {items!r}")
    data["source"] = {**items[0], "also": items[1:]}


def load(path: str | Path | None = None, overrides: list[str] | dict | None = None,
         dag: Any = None) -> Any:
    """The config of ``dag`` (default: the default DAG) from a YAML file and overrides."""
    data: dict = _read_yaml(Path(path)) if path is not None else {}
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for k, v in (overrides or {}).items():
        _set_dotted(data, k, v)
    return from_dict(data, dag)


def __getattr__(name: str) -> Any:
    """``Config`` (the default DAG's composed class) and ``SPEED_ONLY``, built on first use:
    the stages import params.py, and dag.py imports the stages."""
    if name == "Config":
        return config_class()
    if name == "SPEED_ONLY":
        return speed_only()
    raise AttributeError(name)


__all__ = ["Config", "ConfigError", "Resources", "ModelSpec", "FrozenMap", "RunConfig",
           "RayConfig", "FinetuneConfig", "load", "from_dict", "to_dict", "to_json",
           "parse_overrides", "from_snapshot", "field", "config_class", "compose", "sections_of",
           "speed_only", "at_least", "Literal"]
