"""The repo's folders and the installed package agree; the example config documents every key."""
import dataclasses
from pathlib import Path

import yaml

from vlcurate.pipeline import config as C

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_module_and_data_file(tmp_path):
    """The packages are collected from the folders (setup.py): every .py under the top-level
    folders is in the wheel as vlcurate.<folder>..., with the package data."""
    import subprocess
    import sys
    import zipfile
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(REPO)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("vlcurate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = ("schemas", "foundation", "stages", "trainer", "pipeline")
    wanted = {"vlcurate/" + p.relative_to(REPO).as_posix() for top in tops
              for p in (REPO / top).rglob("*.py")}
    assert wanted - names == set()
    assert {"vlcurate/pipeline/configs/example.yaml", "vlcurate/stages/mining/native.c",
            "vlcurate/stages/concepts/wordnet30.txt.xz"} <= names


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
