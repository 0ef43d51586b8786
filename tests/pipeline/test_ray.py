"""End to end on local Ray: real COCO photos, parity with the in-process executor, open_clip's
loader, and a process killed in the middle of a stage."""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest
import webdataset as wds
import yaml

from tests.conftest import shared_data
from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import DEMO_MODELS, demo_overrides, make_demo
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems
from vlcurate.schemas import F, tables
from vlcurate.schemas import embed as E

pytestmark = pytest.mark.slow


def table(path: Path):
    return ds.dataset(path, format="parquet").to_table()


def coco_cfg(run_dir: Path, **over) -> C.Config:
    data = shared_data("coco_mini")
    return C.load(None, {"source.path": str(data), "source.key_column": "caption_id",
                         "source.extra_columns": ["coco_split"], "source.rows_per_part": 150,
                         "run.run_dir": str(run_dir), "run.progress": False,
                         "run.stages": ["ids", "embed"],     # the spine and the embeddings
                         "export.samples_per_shard": 200, **DEMO_MODELS, **over})


@pytest.mark.realdata
def test_coco_mini_on_ray_matches_in_process(ray_local, tmp_path):
    res = run(coco_cfg(tmp_path / "ray", **{"source.max_captions_per_image": 2}), executor="ray",
              log=lambda _: None)
    assert not problems(res)
    m = {r.manifest["stage"]: r.manifest for r in res}
    assert m["ingest"]["rows"] == 239 * 2 and m["ingest"]["parts"] == 4
    assert m["export"]["rows_kept"] == m["export"]["rows_in"] - m["export"]["rows_rejected"]
    assert m["export"]["rows_kept"] >= 470          # COCO photos decode; nothing bogus dropped
    ingest = table(tmp_path / "ray" / "ingest" / "data")
    assert ingest.schema.remove_metadata() == tables.SAMPLES.remove_metadata()
    row = ingest.filter(ds.field(F.KEY.name) == "372891").to_pylist()[0]
    assert row[F.CAPTION.name] == "A woman stands in the dining area at the table."
    assert (row[F.WIDTH.name], row[F.HEIGHT.name], row[F.IMAGE_FORMAT.name]) == (640, 426, "JPEG")
    assert row[F.IMAGE_REENCODED.name] is False     # an RGB JPEG is stored as it came
    assert json.loads(row[F.EXTRA.name]) == {"coco_split": "val2017"}
    # the same stage objects in-process give the same tables and byte-identical shards
    run(coco_cfg(tmp_path / "local", **{"source.max_captions_per_image": 2}), executor="local",
        log=lambda _: None)
    for stage in ("ingest", "ids"):
        assert table(tmp_path / "ray" / stage / "data").equals(table(tmp_path / "local" / stage / "data"))
    # embeddings: equal up to float rounding (Ray workers run torch with 1 thread, so the
    # reductions are ordered differently); everything else exactly
    for stage in ("embed", "export"):
        a, b = (table(tmp_path / x / stage / "data") for x in ("ray", "local"))
        for name in a.column_names:
            if name in (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME):
                va = [v for v in a.column(name).to_pylist() if v is not None]
                vb = [v for v in b.column(name).to_pylist() if v is not None]
                assert len(va) == len(vb) and np.allclose(va, vb, atol=1e-4)
            else:
                assert a.column(name).equals(b.column(name)), name
    shards = sorted((tmp_path / "ray" / "export" / "shards").glob("*.tar"))
    assert len(shards) == 3
    for s in shards:
        assert s.read_bytes() == (tmp_path / "local" / "export" / "shards" / s.name).read_bytes()
    # plain webdataset reads them unchanged
    got = list(wds.WebDataset([str(s) for s in shards], shardshuffle=False).decode("pil")
               .to_tuple("jpg", "txt", "json"))
    assert len(got) == m["export"]["rows_kept"]
    img, txt, meta = got[0]
    assert img.size == (meta["width"], meta["height"]) and txt == meta["caption"]


def open_clip_loader(tars, batch_size: int):
    """open_clip's own WebDataset loader (``get_wds_dataset``) over our shards, RN50's transforms."""
    open_clip = pytest.importorskip("open_clip")
    data_mod = pytest.importorskip("open_clip_train.data")
    args = argparse.Namespace(train_data="::".join(map(str, tars)), train_num_samples=None,
                              train_data_upsampling_factors=None, dataset_resampled=False, seed=0,
                              batch_size=batch_size, workers=0, world_size=1)
    _, _, preprocess = open_clip.create_model_and_transforms("RN50", pretrained=None)
    return data_mod.get_wds_dataset(args, preprocess, is_train=True, epoch=0,
                                    tokenizer=open_clip.get_tokenizer("RN50"))


def test_open_clip_loader_reads_the_shards(tmp_path):
    data = make_demo(tmp_path / "data", n=40)
    cfg = C.load(None, {**demo_overrides(data, tmp_path / "run"), "run.progress": False,
                        "export.samples_per_shard": 16})
    res = run(cfg, executor="local", log=lambda _: None)
    kept = res[-1].manifest["rows_kept"]
    shards = sorted((tmp_path / "run" / "export" / "shards").glob("*.tar"))
    info = open_clip_loader(shards, batch_size=5)
    # open_clip sizes the epoch from our sizes.json (rounded up to whole batches)
    assert info.dataloader.num_batches == math.ceil(kept / 5)
    n = 0
    for images, texts in info.dataloader:
        assert images.shape[1:] == (3, 224, 224) and texts.shape[1] == 77
        n += images.shape[0]
    assert n == info.dataloader.num_batches * 5


def _committed(stage_dir: Path) -> list[Path]:
    """The folders of the committed parts (those with a commit record)."""
    sd = StageDir(stage_dir.parent, stage_dir.name)
    return [Path(sd.part_uri("data", p)) for p in sd.committed()]


def test_killed_mid_stage_resumes_without_redoing_committed_parts(tmp_path):
    data = make_demo(tmp_path / "data", n=900, seed=3)
    over = {**demo_overrides(data, tmp_path / "run"), "source.rows_per_part": 10,
            "run.progress": False, "ray.num_cpus": 2, "run.stages": ["ids"]}
    cfg_file = tmp_path / "config.yaml"
    nested: dict = {}
    for k, v in over.items():
        sec, key = k.split(".", 1)
        if "." in key:   # e.g. embed.image_model: keep nested values as they are
            continue
        nested.setdefault(sec, {})[key] = v
    cfg_file.write_text(yaml.safe_dump(nested))
    cmd = [sys.executable, "-m", "vlcurate.pipeline.cli", "run", str(cfg_file)]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    ingest = tmp_path / "run" / "ingest"
    deadline = time.time() + 240
    try:
        while time.time() < deadline and len(_committed(ingest)) < 3 and proc.poll() is None:
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)   # the driver and its embedded Ray, mid-stage
        proc.wait()
    done = _committed(ingest)
    total = json.loads((ingest / "_attempt.json").read_text())["parts"]
    assert 3 <= len(done) < total, f"kill landed outside the stage: {len(done)}/{total}"
    assert not (ingest / "_manifest.json").exists()
    stamps = {p: p.stat().st_mtime_ns for d in done for p in d.iterdir()}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    man = json.loads((ingest / "_manifest.json").read_text())
    assert man["parts_reused"] == len(done) and man["parts"] == total
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps      # committed parts not redone
    # identical to a clean, uninterrupted run
    clean = C.load(None, {**over, "run.run_dir": str(tmp_path / "clean")})
    run(clean, executor="local", log=lambda _: None)
    for stage in ("ingest", "ids", "export"):
        assert table(tmp_path / "run" / stage / "data").equals(table(tmp_path / "clean" / stage / "data"))
    for s in (tmp_path / "clean" / "export" / "shards").glob("*.tar"):
        assert s.read_bytes() == (tmp_path / "run" / "export" / "shards" / s.name).read_bytes()


def test_gpu_stages_run_on_ray(ray_local, cuda, tmp_path):
    """embed and hpm with GPUs on Ray's actor pools (Ray's map_batches must accept
    a GPU stage's resources). Skipped without a GPU; in gpu_checks.sh."""
    data = make_demo(tmp_path / "data", n=24, seed=7)
    cfg = C.load(None, {**demo_overrides(data, tmp_path / "run"), "run.progress": False,
                        "run.stages": ["embed", "hpm"], "source.rows_per_part": 16,
                        "embed.resources": {"num_gpus": 0.5}, "hpm.device": cuda,
                        "hpm.resources": {"num_gpus": 0.5}})
    res = run(cfg, executor="ray", log=lambda _: None)
    assert not problems(res)
    m = {r.manifest["stage"]: r.manifest for r in res}
    assert m["hpm"]["rows_in"] == m["embed"]["rows_kept"] > 0
