"""End to end on a real S3 HTTP API (moto on loopback): the demo DAG (every stage)
with its source and its run directory in a bucket gives the tables and shards of the same run
on local folders; then `inspect`, `export` with another policy into the bucket, `report`, and a
few HELIP trainer steps reading the shards from the bucket by byte ranges."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from vlcurate.pipeline import config as C
from vlcurate.foundation import storage
from vlcurate.pipeline.cli import main
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.inspect import inspect_run
from vlcurate.pipeline.report import write_report
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.trainer.train import train

pytestmark = pytest.mark.timeout(900)
TINY = {"id": "tiny", "random_init": True}


def quiet(_: str) -> None:
    pass


def shard_bytes(root: str) -> dict[str, bytes]:
    m = storage.read_json(storage.join(root, "manifest.json"))
    return {f["shard"]: storage.read_bytes(storage.join(root, f["shard"])) for f in m["files"]}


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    data = make_demo(tmp / "data", n=24, seed=3)
    bucket = s3.bucket()
    storage.upload_dir(str(data), f"{bucket}/data")
    over = {**demo_overrides(data, tmp / "run"), "run.progress": False,
            "source.rows_per_part": 16}
    local = run(C.load(None, over), executor="local", log=quiet)
    remote_dir = f"{bucket}/run"
    remote = run(C.load(None, {**over, "source.path": f"{bucket}/data",
                               "run.run_dir": remote_dir}), executor="local", log=quiet)
    return {"local": local, "remote": remote, "local_dir": str(tmp / "run"),
            "remote_dir": remote_dir, "bucket": bucket, "tmp": tmp}


def test_every_stage_gives_the_same_tables_and_shards(runs):
    assert [r.manifest["stage"] for r in runs["remote"]] == \
        [r.manifest["stage"] for r in runs["local"]]
    for lo, re_ in zip(runs["local"], runs["remote"]):
        name = lo.manifest["stage"]
        for k in ("rows", "rows_in", "rows_kept", "rows_rejected", "reason_counts", "parts"):
            assert lo.manifest[k] == re_.manifest[k], (name, k)
        a, b = StageDir(runs["local_dir"], name), StageDir(runs["remote_dir"], name)
        for p in range(lo.manifest["parts"]):
            assert a.read(p).equals(b.read(p)), (name, p)
    local = shard_bytes(storage.join(runs["local_dir"], "export", "shards"))
    assert local and shard_bytes(storage.join(runs["remote_dir"], "export", "shards")) == local


def test_inspect_export_report_and_training_from_the_bucket(runs, capsys):
    remote_dir, bucket, tmp = runs["remote_dir"], runs["bucket"], runs["tmp"]
    text = inspect_run(remote_dir)
    assert "ingest" in text and "export" in text
    # another policy, exported into the bucket: only ingest.* drops, so more samples
    out = f"{bucket}/export-loose"
    assert main(["export", remote_dir, "--executor", "local", "--out", out,
                 "--set", "export.drop=[ingest.*]"]) == 0
    loose = storage.read_json(f"{out}/shards/manifest.json")
    strict = storage.read_json(f"{remote_dir}/export/shards/manifest.json")
    assert loose["samples"] > strict["samples"] > 0
    assert loose["policy"]["drop"] == ["ingest.*"]
    path, info = write_report(remote_dir, str(tmp / "report.html"))
    assert "<html" in open(path).read().lower()
    # the trainer streams the bucket's shards; HELIP fetches hard pairs by range
    ft = C.from_dict({"finetune": {
        "shards": f"{remote_dir}/export/shards", "out_dir": f"{bucket}/ft", "model": TINY,
        "batch_size": 4, "steps": 2, "ckpt_every": 2, "lr": 1e-3, "eval_fraction": 0.2,
        "loss": "helip", "progress": False}}).finetune
    done = train(ft, ft.shards, ft.out_dir)
    assert done["steps"] == 2 and storage.exists(f"{bucket}/ft/checkpoint.pt")
    logs = [json.loads(x) for x in storage.read_bytes(f"{bucket}/ft/log.jsonl").splitlines()]
    assert logs[-1]["step"] == 2
    assert pq.read_table(storage.resolve(f"{remote_dir}/summary.parquet")[1],
                         filesystem=storage.resolve(remote_dir)[0]).num_rows == len(runs["remote"])
