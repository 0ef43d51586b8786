"""The repo's folders and the installed package agree; the example config documents every key."""
import dataclasses
import tomllib
from pathlib import Path

import yaml

from vlcurate.pipeline import config as C

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"vlcurate." + ".".join(p.parent.relative_to(REPO).parts)
             for top in ("schemas", "stages", "pipeline", "trainer") for p in (REPO / top).rglob("__init__.py")}
    assert found == listed


def _keys(cls, prefix=""):
    out = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.add(key)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default     # a composed Config's sections are default factories
        if dataclasses.is_dataclass(default) and not isinstance(default, C.Resources):
            out |= _keys(type(default), key + ".")
    return out


def _yaml_keys(d, prefix=""):
    out = set()
    for k, v in d.items():
        out.add(f"{prefix}{k}")
        if isinstance(v, dict) and k not in ("resources", "options"):
            out |= _yaml_keys(v, f"{prefix}{k}.")
    return out


def test_example_config_documents_every_key_and_loads():
    path = REPO / "pipeline" / "configs" / "example.yaml"
    C.load(path)
    assert _yaml_keys(yaml.safe_load(path.read_text())) == _keys(C.Config)
