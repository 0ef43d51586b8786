"""Real trainers read an export's shards as they are: open_clip's training script, Hugging Face
``datasets`` (the shards' dataset card and the annotated Parquet), and ``webdataset`` split
across two nodes. Each test skips when its client is not installed."""
from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.dataset as ds
import pytest

from tests.pipeline.conftest import Export
from vlcurate.schemas import F

pytestmark = pytest.mark.timeout(300)


def brace(e: Export, layout: str) -> str:
    """The shards as one brace pattern (``shard-{000000..000002}.tar``), from the manifest."""
    names = [f[F.SH_NAME.name] for f in e.manifest(layout)["files"]]
    prefix, first = names[0].rsplit("-", 1)
    last = names[-1].rsplit("-", 1)[1]
    return str(e.shards(layout) / f"{prefix}-{{{first[:-4]}..{last[:-4]}}}.tar")


def test_open_clip_trains_on_the_pair_shards(demo_export, tmp_path):
    pytest.importorskip("open_clip_train")
    man = demo_export.manifest("pair")
    cmd = [sys.executable, "-m", "open_clip_train.main", "--dataset-type", "webdataset",
           "--train-data", brace(demo_export, "pair"), "--train-num-samples", str(man["samples"]),
           "--model", "ViT-S-32-alt", "--force-image-size", "64", "--device", "cpu",
           "--warmup", "1", "--batch-size", "8", "--epochs", "1", "--workers", "0",
           "--precision", "fp32", "--logs", str(tmp_path), "--name", "run",
           "--log-every-n-steps", "1", "--save-frequency", "1", "--report-to", ""]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    assert "Train Epoch: 0" in log, log[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "epoch_1.pt").exists()


@pytest.mark.parametrize("source", ["demo_export", "coco_export"])
def test_hf_datasets_reads_the_shards_through_their_card(source, request, tmp_path):
    """Annotations null or empty in the first samples and set later (the failure of a guessed
    type) arrive: the card names the features."""
    datasets = pytest.importorskip("datasets")
    e = request.getfixturevalue(source)
    for layout in ("pair", "image"):
        got = datasets.load_dataset(str(e.shards(layout)), split="train",
                                    cache_dir=str(tmp_path / layout))
        assert got.num_rows == e.manifest(layout)["samples"]
        row = got[0]
        assert row["txt"] and row["jpg"].size[0] > 0
        doc = row["json"] if layout == "pair" else row["json"]["captions"][0]
        assert doc[F.CAPTION.name]


def test_hf_datasets_reads_the_annotated_parquet(demo_export, tmp_path):
    datasets = pytest.importorskip("datasets")
    files = sorted(str(p) for p in (demo_export.run_dir / "export" / "data").rglob("*.parquet"))
    got = datasets.load_dataset("parquet", data_files=files, split="train",
                                cache_dir=str(tmp_path))
    table = ds.dataset(demo_export.run_dir / "export" / "data", format="parquet").to_table()
    assert got.num_rows == table.num_rows
    assert F.KEEP.name in got.column_names and F.CAPTION.name in got.column_names
    assert sum(got[F.KEEP.name]) == demo_export.manifest("pair")["rows"]


def _node(urls: str, rank: int, monkeypatch) -> list[tuple[str, str]]:
    wds = pytest.importorskip("webdataset")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = wds.WebDataset(urls, nodesplitter=wds.split_by_node, shardshuffle=False).decode("pil").to_tuple("__key__", "txt", "jpg")
    return [(key, txt) for key, txt, _ in data]


def test_webdataset_splits_the_shards_between_two_nodes(demo_export, monkeypatch):
    assert len(demo_export.tars("pair")) >= 2
    urls = brace(demo_export, "pair")
    nodes = [_node(urls, r, monkeypatch) for r in (0, 1)]
    assert nodes[0] and nodes[1] and not set(nodes[0]) & set(nodes[1])
    assert len(nodes[0]) + len(nodes[1]) == demo_export.manifest("pair")["samples"]


def test_webdataset_reads_an_image_sample_with_all_its_captions(demo_export):
    wds = pytest.importorskip("webdataset")
    data = wds.WebDataset(brace(demo_export, "image"), shardshuffle=False).decode("pil")
    samples = list(data.to_tuple("jpg", "txt", "json"))
    man = demo_export.manifest("image")
    assert len(samples) == man["samples"]
    assert sum(len(doc["captions"]) for _, _, doc in samples) == man["rows"]
    image, txt, doc = next(s for s in samples if len(s[2]["captions"]) > 1)
    assert image.size[0] > 0 and txt == doc["captions"][0][F.CAPTION.name]
    assert json.dumps(doc["image"]) and F.IMAGE_GROUP.name in doc["image"]
