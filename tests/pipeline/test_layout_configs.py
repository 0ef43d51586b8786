"""The example configs are generic, plus one per common layout. Each loads; the COCO
and Flickr ones read their real data with unique, stable keys; the offline small-data config
runs the whole DAG on a slice of Flickr8k and keeps a sensible share."""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from tests.paths import SHARED_DATA
from vlcurate.pipeline import config as C
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems
from vlcurate.schemas import F
from vlcurate.stages.ingest import readers

CONFIGS = Path(__file__).resolve().parents[2] / "pipeline" / "configs"
LAYOUTS = ("example", "coco", "flickr", "img2dataset", "small")


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_config_loads(name):
    cfg = C.load(CONFIGS / f"{name}.yaml")
    assert cfg.source.kind in ("folder", "img2dataset")


@pytest.mark.parametrize("name,data", [("coco", "coco_mini"), ("flickr", "flickr8k_224")])
def test_coco_and_flickr_configs_read_their_layout(name, data, tmp_path):
    if not (SHARED_DATA / data).exists():
        pytest.skip(f"{data} not present")
    src = C.load(CONFIGS / f"{name}.yaml").source
    specs = readers.plan(src, str(tmp_path / "plan.parquet"))
    t = readers.read_part(src, specs[0])
    keys = t.column(F.KEY.name).to_pylist()
    assert len(keys) == len(set(keys)) == min(src.rows_per_part, t.num_rows) > 0
    assert not any(t.column(F.READ_ERROR.name).to_pylist())
    if name == "flickr":
        assert keys[0].endswith("#0") and keys[1].endswith("#1")   # <image>#<n>


def flickr_slice(root: Path, images: int) -> Path:
    """The first ``images`` photos of Flickr8k with their five captions each."""
    base = SHARED_DATA / "flickr8k_224"
    (root / "images").mkdir(parents=True)
    with open(base / "captions.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    keep = list(dict.fromkeys(r["image"] for r in rows))[:images]
    for name in keep:
        shutil.copy(base / "images" / name, root / "images" / name)
    with open(root / "captions.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(r for r in rows if r["image"] in set(keep))
    return root


def test_the_small_data_config_runs_offline_and_keeps_a_sensible_share(tmp_path):
    if not (SHARED_DATA / "flickr8k_224").exists():
        pytest.skip("flickr8k_224 not present")
    data = flickr_slice(tmp_path / "data", 40)
    cfg = C.load(CONFIGS / "small.yaml", {"source.path": str(data), "run.progress": False,
                                           "run.run_dir": str(tmp_path / "run")})
    results = run(cfg, executor="local", log=lambda _: None)
    assert not problems(results)
    m = {r.manifest["stage"]: r.manifest for r in results}
    assert m["ingest"]["rows"] == 200 and m["ingest"]["rows_kept"] == 200
    kept = m["export"]["rows_kept"] / m["ingest"]["rows"]
    assert 0.1 <= kept <= 0.9, kept        # the filters bite, and they do not reject everything
