"""The layers point one way (pyproject.toml's [tool.importlinter]): schemas at the bottom, then
foundation, then stages and the trainer (neither importing the other), pipeline on top; the stage
packages import none of each other. lint-imports names every import that breaks them."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache", *args], cwd=REPO, capture_output=True, text=True)


def test_the_imports_keep_the_layers():
    got = lint()
    assert got.returncode == 0, f"imports against the layers:\n{got.stdout[-6000:]}{got.stderr}"
    assert "0 broken" in got.stdout


def test_an_import_against_the_layers_is_named(tmp_path):
    """The same check with the layers upside down: it fails, naming the imports."""
    config = tmp_path / "upside_down.toml"
    config.write_text('[tool.importlinter]\nroot_packages = ["vlcurate.schemas", '
                      '"vlcurate.foundation", "vlcurate.stages", "vlcurate.trainer", '
                      '"vlcurate.pipeline"]\n\n[[tool.importlinter.contracts]]\n'
                      'name = "upside down"\ntype = "layers"\n'
                      'layers = ["vlcurate.schemas", "vlcurate.pipeline"]\n')
    got = lint("--config", str(config))
    assert got.returncode == 1 and "upside down BROKEN" in got.stdout
    assert "vlcurate.pipeline.runner -> vlcurate.schemas" in got.stdout
