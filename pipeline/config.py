"""Typed, frozen run configuration loaded from YAML (values only; the DAG lives in dag.py).

An unknown key, a wrong type or a bad value is a :class:`ConfigError` that names the dotted key,
e.g. ``ingest.max_pixels: expected int, got 'lots'``.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    pass


# --- sections ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resources:
    """Ray resources for one stage. ``None`` means "the stage's own default"."""
    num_cpus: Optional[float] = None
    num_gpus: Optional[float] = None
    batch_size: Optional[int] = None     # rows per map_batches call; 0 = a whole part at a time
    concurrency: Optional[int] = None    # actor-pool size (callable-class stages)


@dataclass(frozen=True)
class RunConfig:
    run_dir: str = "runs/default"
    # Heavy stages skip rows already flagged upstream (they get nulls). True computes every
    # ingested row, so that any later export policy finds its annotations.
    compute_on_flagged: bool = False
    progress: bool = True


@dataclass(frozen=True)
class RayConfig:
    # None: $RAY_ADDRESS if set, else an embedded local Ray. "local" forces the embedded one.
    address: Optional[str] = None
    num_cpus: Optional[int] = None       # embedded Ray only
    num_gpus: Optional[int] = None       # embedded Ray only
    # Keep Ray's own per-operator progress bars (vlcurate prints one bar per stage anyway).
    ray_progress_bars: bool = False


@dataclass(frozen=True)
class SourceConfig:
    kind: Literal["folder", "parquet", "webdataset", "img2dataset"] = "folder"
    path: str = ""
    name: Optional[str] = None           # default: the source folder's name
    # folder: a captions CSV or JSONL (relative to path) and the folder the images are in
    captions_file: Optional[str] = None  # default: captions.csv, captions.jsonl or metadata.jsonl
    images_dir: str = "images"           # relative to path; "" = path itself
    image_column: str = "image"          # folder/parquet: file name / path / bytes column
    caption_column: str = "caption"
    key_column: Optional[str] = None     # default: image name (+ "#n" for its n-th caption)
    extra_columns: tuple[str, ...] = ()  # copied into the `extra` JSON column
    max_captions_per_image: Optional[int] = None
    rows_per_part: int = 1000            # folder/parquet: rows per part; tars: one part per tar


@dataclass(frozen=True)
class IngestConfig:
    max_pixels: int = 89_478_485         # PIL's own bomb threshold; larger headers are rejected
    min_side: int = 8
    max_caption_chars: int = 2048
    # auto: keep the source bytes when they are an RGB JPEG needing no EXIF rotation, else
    # re-encode the decoded RGB image as JPEG; always: always re-encode
    reencode: Literal["auto", "always"] = "auto"
    jpeg_quality: int = 95
    resources: Resources = Resources()


@dataclass(frozen=True)
class IdsConfig:
    resources: Resources = Resources()


@dataclass(frozen=True)
class ExportConfig:
    # fnmatch patterns of reason codes that drop a row; "ingest.*" always drops.
    drop: tuple[str, ...] = ("*",)
    samples_per_shard: int = 10_000
    shard_prefix: str = "shard"
    exclude_columns: tuple[str, ...] = ()  # left out of the annotated table and the shard json
    out_dir: Optional[str] = None          # default: <run_dir>/export
    resources: Resources = Resources()


@dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    ray: RayConfig = RayConfig()
    source: SourceConfig = SourceConfig()
    ingest: IngestConfig = IngestConfig()
    ids: IdsConfig = IdsConfig()
    export: ExportConfig = ExportConfig()

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def replace(self, **overrides: Any) -> "Config":
        """Return a copy with dotted-key overrides applied (``replace(**{"export.drop": []})``)."""
        data = to_dict(self)
        for k, v in overrides.items():
            _set_dotted(data, k, v)
        return from_dict(data)


# --- conversion ----------------------------------------------------------------------------------
def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def to_json(obj: Any) -> str:
    """Canonical JSON (sorted keys): the input to fingerprints."""
    return json.dumps(to_dict(obj), sort_keys=True, separators=(",", ":"))


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _convert(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of "
                          f"{[_type_name(a) for a in inner]}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0]
        return tuple(_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - a bug in this file


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"{key}: unknown key{hint}")
        kwargs[k] = _convert(v, hints[k], key)
    obj = cls(**kwargs)
    _validate(obj, prefix)
    return obj


_POSITIVE = {"rows_per_part", "samples_per_shard", "max_pixels", "max_caption_chars", "min_side"}


def _validate(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in _POSITIVE and isinstance(v, int) and v <= 0:
            raise ConfigError(f"{key}: must be > 0, got {v}")
        if f.name == "jpeg_quality" and not 1 <= v <= 100:
            raise ConfigError(f"{key}: must be in 1..100, got {v}")
        if isinstance(obj, Resources) and v is not None and v < 0:
            raise ConfigError(f"{key}: must be >= 0, got {v}")


def from_dict(data: dict | None) -> Config:
    return _build(Config, data or {}, "")


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


def load(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}")
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        # a relative source.path is relative to the config file's folder (run_dir: to the cwd)
        src = data.get("source")
        val = src.get("path") if isinstance(src, dict) else None
        if isinstance(val, str) and val and not Path(val).is_absolute() and "://" not in val:
            src["path"] = str((p.parent / val).resolve())
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for k, v in (overrides or {}).items():
        _set_dotted(data, k, v)
    return from_dict(data)


__all__ = ["Config", "ConfigError", "Resources", "RunConfig", "RayConfig", "SourceConfig",
           "IngestConfig", "IdsConfig", "ExportConfig", "load", "from_dict", "to_dict", "to_json",
           "parse_overrides", "field"]
