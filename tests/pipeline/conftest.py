"""Runs shared by the modules that test what readers see of an export: one ``vlcurate run`` in
the image layout and its ``vlcurate export`` in the pair layout, per source, once a session."""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, shared_data

SMALL = REPO / "pipeline" / "configs" / "small.yaml"


@dataclass
class Export:
    """A run (``run_dir``; its export in the image layout) and its re-export in the pair layout
    (``pair``), with each command's exit code and printed summary."""
    run_dir: Path
    pair: Path
    codes: dict
    out: dict

    def shards(self, layout: str) -> Path:
        return (self.run_dir / "export" if layout == "image" else self.pair) / "shards"

    def manifest(self, layout: str) -> dict:
        return json.loads((self.shards(layout) / "manifest.json").read_text())

    def tars(self, layout: str) -> list[Path]:
        return sorted(self.shards(layout).glob("*.tar"))


def _cli(args: list[str]) -> tuple[int, str]:
    from vlcurate.pipeline.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(args)
    return code, buf.getvalue()


def run_both_layouts(root: Path, sets: dict) -> Export:
    """``vlcurate run`` of the README's small config with ``sets`` (image layout; the spine, CAT,
    export: the stages whose annotations readers see without models), then ``vlcurate export
    --set export.layout=pair``."""
    run_dir, pair = root / "run", root / "pair"
    sets = {"run.run_dir": str(run_dir), "run.progress": "false", "run.stages": "[ids, cat]",
            "export.layout": "image", "export.samples_per_shard": "100", **sets}
    flags = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    codes, out = {}, {}
    codes["image"], out["image"] = _cli(["run", str(SMALL), "--executor", "local", *flags])
    codes["pair"], out["pair"] = _cli(["export", str(run_dir), "--executor", "local", "--out",
                                       str(pair), "--set", "export.layout=pair"])
    return Export(run_dir, pair, codes, out)


@pytest.fixture(scope="session")
def coco_export(tmp_path_factory) -> Export:
    """coco_mini (239 photos, 1,195 captions: five an image) as the README's small config runs
    it, in both layouts."""
    data = shared_data("coco_mini")
    return run_both_layouts(tmp_path_factory.mktemp("coco_export"), {
        "source.path": str(data), "source.key_column": "caption_id",
        "source.extra_columns": "[coco_split]", "source.rows_per_part": "400"})


@pytest.fixture(scope="session")
def demo_export(tmp_path_factory) -> Export:
    """The demo with three captions for ten of its images (no shared data needed)."""
    from tests.trainer.test_layouts import captions_together
    from vlcurate.pipeline.demo import make_demo
    root = tmp_path_factory.mktemp("demo_export")
    data = make_demo(root / "data", n=60, seed=4)
    captions_together(data)
    return run_both_layouts(root, {"source.path": str(data), "source.key_column": "id",
                                   "source.extra_columns": "[]", "source.rows_per_part": "30",
                                   "export.samples_per_shard": "16"})
