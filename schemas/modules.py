"""The schema modules, collected: a stage's schema module is picked up by being in this package,
with no list to edit. A module may declare ``ALL`` (its table schemas, by table name) and
``REASON_CODES`` (its reason codes, by constant name: ``{"LANG_OTHER": "lang.other"}``); it never
imports ``reasons``, which collects them."""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Iterable, Optional

NOT_DECLARING = ("modules", "reasons")     # this collector, and the module that collects reasons


def found(package: str = __package__, path: Optional[Iterable[str]] = None) -> list[ModuleType]:
    """Every public module of ``package`` (by name), imported."""
    path = importlib.import_module(package).__path__ if path is None else path
    names = sorted(m.name for m in pkgutil.iter_modules(list(path)))
    return [importlib.import_module(f"{package}.{n}") for n in names
            if not n.startswith("_") and n not in NOT_DECLARING]


def merged(modules: Iterable[ModuleType], attr: str) -> dict:
    """The union of each module's ``attr`` dict; a key declared by two modules is an error."""
    out: dict = {}
    where: dict = {}
    for mod in modules:
        for key, value in getattr(mod, attr, {}).items():
            if key in out:
                raise ValueError(f"{attr}[{key!r}] is declared by {where[key]} and {mod.__name__}")
            out[key], where[key] = value, mod.__name__
    return out


def reason_codes(modules: Iterable[ModuleType], taken: Iterable[str] = ()) -> dict[str, str]:
    """Every module's ``REASON_CODES``, checked: each code is ``<stage>.<reason>`` and used once."""
    codes = merged(modules, "REASON_CODES")
    seen = set(taken)
    for name, code in codes.items():
        if not isinstance(code, str) or code.count(".") != 1 or not all(code.split(".")):
            raise ValueError(f"reason {name} = {code!r}: a code is '<stage>.<reason>'")
        if code in seen:
            raise ValueError(f"reason code {code!r} ({name}) is declared twice")
        seen.add(code)
    return codes
