"""The installed packages, collected: every folder with an ``__init__.py`` under the top-level
folders (``TOPS``), installed as ``vlcurate.<folder>.<sub>`` (``stages/mining`` is
``vlcurate.stages.mining``). A new stage package needs no list edit; the rest of the build is
``pyproject.toml``'s (``tests/test_packaging.py`` checks the wheel)."""
from pathlib import Path

from setuptools import setup

TOPS = ("schemas", "foundation", "stages", "trainer", "pipeline")
ROOT = Path(__file__).resolve().parent


def packages() -> list[str]:
    return sorted(".".join(("vlcurate", *p.parent.relative_to(ROOT).parts))
                  for top in TOPS for p in (ROOT / top).rglob("__init__.py"))


setup(packages=packages(), package_dir={f"vlcurate.{top}": top for top in TOPS})
