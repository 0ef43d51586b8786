"""Parameters: the frozen dataclasses a stage owns (its config section), and the one way they are
built from YAML and validated.

A section is a frozen dataclass deriving from :class:`Params`. Per-field rules are declared on
the field (``k: int = positive(100)``, ``tau: float = unit(0.5)``); rules that relate fields are
a ``check()`` method yielding ``(field, message)``. Every failure is a :class:`ConfigError` that
names the dotted key (``hpm.k: must be an int > 0, got 0``); an unknown key suggests the nearest.
Nothing here imports a stage: stages import this module, ``config.py`` composes them.
"""
from __future__ import annotations

import contextvars
import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterable, Literal, Optional


class ConfigError(ValueError):
    pass


class DataError(ConfigError):
    """What a stage raises when this data and this config cannot go together (a small-data
    guard, a threshold no row can meet): a sentence naming the key to change. The CLI prints it
    as one ``error:`` line with exit code 2, from the driver or from a Ray worker alike."""


class FrozenMap(dict):
    """A read-only, hashable mapping for free-form option values (e.g. a model's kwargs)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))

    def __reduce__(self) -> Any:  # pickle through the constructor, not item assignment
        return (FrozenMap, (dict(self),))

    def _ro(self, *a: Any, **k: Any) -> None:
        raise TypeError("config mappings are read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _ro  # type: ignore


# --- per-field rules ---------------------------------------------------------------------------
Rule = Callable[[Any], Optional[str]]   # value -> None (fine) or what is wrong


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rule(default: Any, rule: Optional[Rule], doc: str = "") -> Any:
    """A field with its rule and its doc string (what the key means: the one place a key is
    documented; example.yaml and the README's key reference are generated from it)."""
    meta = {"doc": doc} if rule is None else {"rule": rule, "doc": doc}
    if isinstance(default, (list, dict, set)) or (dataclasses.is_dataclass(default)
                                                   and not isinstance(default, type)):
        return dataclasses.field(default_factory=lambda d=default: d, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def doc(default: Any, text: str) -> Any:
    """A field without a rule beyond its type, with its doc string."""
    return _rule(default, None, text)


def field_doc(f: dataclasses.Field) -> str:
    return f.metadata.get("doc", "")


def positive(default: Any, doc: str = "") -> Any:
    """An int > 0 (or null, where the field allows it)."""
    return _rule(default, lambda v: None if v is None or (
        isinstance(v, int) and not isinstance(v, bool) and v > 0) else f"must be an int > 0, got {v!r}",
        doc)


def at_least(default: Any, lo: float, doc: str = "") -> Any:
    return _rule(default, lambda v: None if v is None or (_number(v) and v >= lo)
                 else f"must be >= {lo}, got {v!r}", doc)


def above(default: Any, lo: float, doc: str = "") -> Any:
    return _rule(default, lambda v: None if v is None or (_number(v) and v > lo)
                 else f"must be > {lo}, got {v!r}", doc)


def within(default: Any, lo: float, hi: float, *, open_hi: bool = False, doc: str = "") -> Any:
    """A number in [lo, hi] ([lo, hi) with ``open_hi``), or null where allowed."""
    def rule(v: Any) -> Optional[str]:
        ok = v is None or (_number(v) and lo <= v and (v < hi if open_hi else v <= hi))
        return None if ok else f"must be in [{lo}, {hi}{')' if open_hi else ']'}, got {v!r}"
    return _rule(default, rule, doc)


def unit(default: Any, doc: str = "") -> Any:
    """A number in [0, 1] (a share, a threshold on a [0, 1] score), or null where allowed."""
    return within(default, 0, 1, doc=doc)


def nonempty(default: Any, hint: str = "", doc: str = "") -> Any:
    return _rule(default, lambda v: None if v else f"must not be empty{hint}", doc)


_BUILDING = contextvars.ContextVar("building", default=False)


class Params:
    """Base of every config section. ``section`` (the dotted prefix of its keys in messages) is
    set by the stage that owns the section (``stages.base.Stage``) or by ``config.py``. Built
    directly (``HpmParams(k=0)``) it checks itself; :func:`build` checks it with the full key."""
    section: ClassVar[str] = ""
    # fields added after run directories existed: they enter fingerprints only when set away
    # from their defaults, so that an old run's stages are not redone for a field it never had
    fingerprint_when_set: ClassVar[tuple[str, ...]] = ()
    # keys moved elsewhere: {old field: its new dotted key}; an old config naming one gets an
    # error saying where it went (``hpm.probe: moved to hpm.engine.probe``)
    moved_keys: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        if not _BUILDING.get():
            check(self, self.section)

    def check(self) -> Iterable[tuple[str, str]]:
        """Rules between fields: yield (field name, what is wrong)."""
        return ()


def check(obj: Any, prefix: str) -> None:
    """Every field rule of ``obj``, then its ``check()``; the first failure is a ConfigError."""
    problems = []
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("rule")
        msg = rule(getattr(obj, f.name)) if rule else None
        if msg:
            problems.append((f.name, msg))
    if not problems and hasattr(obj, "check"):
        problems = list(obj.check())
    if problems:
        name, msg = problems[0]
        raise ConfigError(f"{prefix}.{name}: {msg}" if prefix else f"{name}: {msg}")


@dataclass(frozen=True)
class ModelSpec(Params):
    """A model: an id (timm name, Hugging Face repo id, sentence-transformers id) plus an optional
    local path. Loading order: ``path``, else the local cache, else (only with ``allow_download``)
    the hub. ``random_init`` builds the architecture with random weights (tests, demos) and every
    output row says so. ``options``: extra constructor arguments (e.g. a tiny test config)."""
    id: str = doc("", "the model: a timm name, a Hugging Face repo id or a sentence-transformers "
                      "id")
    path: Optional[str] = doc(None, "a weights file, or a folder holding one; null: the local "
                                    "Hugging Face cache")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = doc(
        "auto", "the weights' dtype; auto: bf16 autocast on a GPU, float32 on a CPU")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto: cuda when a GPU is visible")
    random_init: bool = doc(False, "build the architecture with seeded random weights (tests, "
                                   "demos); every output row says so")
    allow_download: bool = doc(False, "fetch missing weights from the hub")
    options: FrozenMap = doc(FrozenMap(), "extra constructor arguments (e.g. a tiny test "
                                          "config)")

    def check(self) -> Iterable[tuple[str, str]]:
        if self.random_init and self.path:
            yield ("path", f"is set ({self.path}) but random_init is true, which would ignore it: "
                           "set random_init: false to load these weights")


@dataclass(frozen=True)
class Resources(Params):
    """Resources for one stage. A stage class declares its defaults (``resources =
    Resources(num_cpus=1, batch_size=0)``); its config section's ``resources`` overrides them
    field by field; what neither sets is :data:`DEFAULT_RESOURCES`. ``None``: not set here."""
    num_cpus: Optional[float] = at_least(None, 0, doc="CPUs per task or actor")
    num_gpus: Optional[float] = at_least(None, 0, doc="GPUs (or a fraction) per actor")
    batch_size: Optional[int] = at_least(None, 0, doc=(
        "rows per stage call, rounded up to whole chunks; 0: a whole part"))
    concurrency: Optional[int] = at_least(None, 0, doc=(
        "actor-pool size (stages on actors); null: as large as the cluster allows"))

    def over(self, base: "Resources") -> "Resources":
        """These settings, with ``base``'s where these are unset."""
        return Resources(**{f.name: getattr(base, f.name) if getattr(self, f.name) is None
                            else getattr(self, f.name) for f in dataclasses.fields(self)})


# 1 CPU, no GPU, a whole part per call, an actor pool as large as the cluster allows
DEFAULT_RESOURCES = Resources(num_cpus=1.0, num_gpus=0.0, batch_size=0, concurrency=None)


# --- conversion --------------------------------------------------------------------------------
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


def _union(value: Any, args: tuple, key: str) -> Any:
    if value is None and type(None) in args:
        return None
    inner = [a for a in args if a is not type(None)]
    errors = []
    for a in inner:
        try:
            return convert(value, a, key)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of "
                      f"{[_type_name(a) for a in inner]}")


def _mapping(value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping, got {value!r}")
    return value


_SCALARS: dict[type, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true/false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "int"),
    float: (_number, "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def convert(value: Any, tp: Any, key: str) -> Any:
    """``value`` (parsed YAML) as type ``tp``, or a ConfigError naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(value, args, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else build(tp, _mapping(value, key), key)
    if tp is FrozenMap:
        return FrozenMap(_mapping(value, key))
    if tp in _SCALARS:
        ok, name = _SCALARS[tp]
        if not ok(value):
            raise ConfigError(f"{key}: expected {name}, got {value!r}")
        return float(value) if tp is float else value
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - a bug in a section


def unknown_key(key: str, name: str, known: Iterable[str]) -> ConfigError:
    known = list(known)
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
    return ConfigError(f"{key}: unknown key{hint}")


def build(cls: type, data: dict, prefix: str) -> Any:
    """``cls`` from a mapping; keys not given keep their defaults. A partial mapping for a nested
    section edits that field's default (``--set embed.image_model.path=X`` keeps the default
    model's id), except a model spec naming another ``id``, which starts from a blank spec."""
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING
                else f.default for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in defaults:
            moved = getattr(cls, "moved_keys", {}).get(k)
            if moved:
                raise ConfigError(f"{key}: moved to {moved}")
            raise unknown_key(key, k, defaults)
        if isinstance(v, dict) and dataclasses.is_dataclass(defaults[k]) and \
                not (isinstance(defaults[k], ModelSpec) and "id" in v):
            v = {**to_dict(defaults[k]), **v}
        kwargs[k] = convert(v, hints[k], key)
    token = _BUILDING.set(True)
    try:
        obj = cls(**kwargs)
    finally:
        _BUILDING.reset(token)
    check(obj, prefix)
    return obj
