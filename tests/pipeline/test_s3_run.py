"""A run whose run directory is a bucket on a real S3 HTTP endpoint (moto on loopback): the
runner, `inspect` and `report` on it, credentials never recorded, and kill -9 in the middle of a
stage then a rerun, byte-identical to a clean run with the committed parts reused."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.pipeline.test_determinism import differing, snapshot
from tests.pipeline.test_runner import CharCount, ShortCaptionFilter, by_stage, cfg_for, quiet
from vlcurate.foundation import storage
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.demo import make_demo
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems
from vlcurate.stages.ingest import IngestStage

STAGES = ("ingest", "shortcap", "charcount")


def dag():
    """ingest -> a filter -> a stage after it: no global step, no finalize (their work folders
    are the executors' business)."""
    return [Node(IngestStage), Node(ShortCaptionFilter, after=("ingest",)),
            Node(CharCount, after=("shortcap",))]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The demo pairs as a Parquet source (image bytes in a column), 10 rows a row group: one
    part each."""
    root = tmp_path_factory.mktemp("s3src")
    demo = make_demo(root / "demo", n=40, seed=5)
    with open(demo / "captions.csv", encoding="utf-8", errors="replace") as fh:
        recs = list(csv.DictReader(fh))
    t = pa.table({"id": [r["id"] for r in recs], "caption": [r["caption"] for r in recs],
                  "image": [(demo / "images" / r["image"]).read_bytes()
                            if (demo / "images" / r["image"]).is_file() else b"" for r in recs]})
    (root / "pq").mkdir()
    pq.write_table(t, root / "pq" / "pairs.parquet", row_group_size=10)
    return root / "pq"


def config(source: Path, run_dir: str, **over):
    return cfg_for(source, run_dir, **{"source.kind": "parquet", "source.path": str(source),
                                       "source.extra_columns": [], **over})


def test_a_run_on_s3_then_inspect_and_report(s3, source, tmp_path):
    bucket = s3.bucket()
    run_dir = f"{bucket}/runs/a"
    res = by_stage(run(config(source, run_dir), dag=dag(), executor="local", log=quiet))
    assert not problems(list(res.values())) and set(res) == set(STAGES)
    parts = res["ingest"].manifest["parts"]
    assert parts >= 4 and res["charcount"].manifest["rows"] == res["ingest"].manifest["rows"]
    for s in STAGES:
        sd = StageDir(run_dir, s)
        assert sd.committed() == list(range(parts)) and sd.damaged(parts) == []
        assert sd.manifest()["status"] == "complete"
    kept = StageDir(run_dir, "shortcap").read_all().num_rows
    assert kept == res["ingest"].manifest["rows"]
    assert storage.read_json(storage.join(run_dir, "run.json"))["dag"] == list(STAGES)
    assert storage.exists(storage.join(run_dir, "summary.parquet"))
    assert not storage.exists(storage.join(run_dir, ".lock"))
    assert not os.path.exists("s3:")             # nothing landed in a local folder named s3:
    # a local run of the same config writes the same bytes
    local = tmp_path / "local"
    run(config(source, str(local)), dag=dag(), executor="local", log=quiet)
    assert differing(snapshot(run_dir), snapshot(str(local))) == []
    # inspect and report read the bucket
    from vlcurate.pipeline.inspect import inspect_run
    from vlcurate.pipeline.report import write_report
    text = inspect_run(run_dir)
    assert f"run: {run_dir}" in text and "== shortcap" in text and "test.short_caption" in text
    path, info = write_report(run_dir, str(tmp_path / "r.html"))
    page = Path(path).read_text()
    assert run_dir in page and "test.short_caption" in page
    path, _ = write_report(run_dir)               # by default, into the run directory
    assert path == storage.join(run_dir, "report.html") and storage.size(path) > 1000


def test_credentials_in_a_uri_are_never_recorded(s3, source, capsys):
    """``s3://KEY:SECRET@bucket``: run.json, the manifests, the log, inspect and report carry the
    redacted URI."""
    bucket = s3.bucket().split("//")[1]
    secret = "SECRETxyz42"
    run_dir = f"s3://testing:{secret}@{bucket}/runs/b"
    lines: list[str] = []
    cfg = config(source, run_dir, **{"export.out_dir": f"s3://k:{secret}@{bucket}/x?region=us-east-1"})
    run(cfg, dag=dag(), executor="local", log=lines.append)
    plain = f"s3://{bucket}/runs/b"
    written = [storage.read_bytes(storage.join(plain, i.path.split("/runs/b/", 1)[1]))
               for i in storage.list_files(plain) if i.base_name.endswith(".json")]
    assert len(written) > 10
    from vlcurate.pipeline.cli import main
    assert main(["inspect", run_dir]) == 0
    assert main(["report", run_dir]) == 0
    shown = capsys.readouterr().out
    assert f"s3://***@{bucket}/runs/b" in shown
    page = storage.read_bytes(storage.join(plain, "report.html"))
    for blob in (*written, "\n".join(lines).encode(), shown.encode(), page):
        assert secret.encode() not in blob
    rec = storage.read_json(storage.join(plain, "run.json"))
    assert rec["config"]["run"]["run_dir"] == f"s3://***@{bucket}/runs/b"
    assert rec["config"]["export"]["out_dir"] == f"s3://***@{bucket}/x?region=us-east-1"


KILL_SCRIPT = """
import sys, time
from tests.pipeline import test_s3_run as T
from tests.pipeline.test_runner import ShortCaptionFilter
from vlcurate.pipeline.runner import run
real = ShortCaptionFilter.__call__
def slow(self, batch):
    time.sleep(0.25)
    return real(self, batch)
ShortCaptionFilter.__call__ = slow
run(T.config(T.Path(sys.argv[1]), sys.argv[2], **{"source.rows_per_part": 4}), dag=T.dag(),
    executor="local", log=print)
"""


@pytest.mark.slow
def test_killed_mid_stage_on_s3_resumes_identical_to_a_clean_run(s3, source):
    bucket = s3.bucket()
    run_dir, clean = f"{bucket}/runs/killed", f"{bucket}/runs/clean"
    cmd = [sys.executable, "-c", KILL_SCRIPT, str(source), run_dir]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).parents[2], env=os.environ.copy(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    sd = StageDir(run_dir, "shortcap")
    deadline = time.time() + 240
    try:
        while time.time() < deadline and len(sd.committed()) < 3 and proc.poll() is None:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)           # the driver, mid-stage
        proc.wait()
    done = sd.committed()
    total = sd.attempt()["parts"]
    assert 3 <= len(done) < total, f"kill landed outside the stage: {len(done)}/{total}"
    assert sd.manifest() is None
    records = {p: sd.record(p) for p in done}
    cfg = config(source, run_dir, **{"source.rows_per_part": 4})
    res = by_stage(run(cfg, dag=dag(), executor="local", log=quiet))
    assert res["ingest"].status == "skipped" and res["shortcap"].status == "resumed"
    assert res["shortcap"].manifest["parts_reused"] == len(done)
    assert {p: sd.record(p) for p in done} == records      # the committed parts were not redone
    run(config(source, clean, **{"source.rows_per_part": 4}), dag=dag(), executor="local",
        log=quiet)
    assert differing(snapshot(run_dir), snapshot(clean)) == []
    assert not [i for s in STAGES for i in storage.list_files(storage.join(run_dir, s, "data"))
                if i.base_name not in StageDir(run_dir, s).files(
                    int(i.path.split("/")[-2].split("-")[1]))]   # stale fragments swept


def test_inspect_and_report_of_a_finished_run_copied_to_a_bucket(s3, tmp_path):
    """A local run with shards (the spine: ingest, ids, export) copied to S3 with upload_dir:
    inspect says the same as on the folder, and the report shows the shards' thumbnails, read by
    byte ranges through the shard index."""
    from tests.pipeline.test_runner import spine
    from vlcurate.pipeline.inspect import inspect_run
    from vlcurate.pipeline.report import render
    data = make_demo(tmp_path / "data", n=30, seed=4)
    local = tmp_path / "run"
    run(cfg_for(data, local), dag=spine(), executor="local", log=quiet)
    uri = f"{s3.bucket()}/copied/run"
    storage.upload_dir(str(local), uri)
    at = len(s3.log)
    text = inspect_run(uri)
    assert len(s3.lists(at)) < 12                 # a few LISTs per stage, none per part
    assert text.replace(uri, "RUN") == inspect_run(local).replace(str(local), "RUN")
    assert "shards:" in text and "ingest.duplicate_id" in text
    page, info = render(uri, sample=4)
    ref, _ = render(local, sample=4)
    assert "data:image/jpeg;base64," in page and page.count("<img") == ref.count("<img") > 0
    tars = [r for r in s3.log[at:] if r[0] == "GET" and r[1].endswith(".tar")]
    assert tars and all(r[3].startswith("bytes=") for r in tars)   # byte ranges only
    fetched = sum(int(b) - int(a) + 1 for r in tars for a, b in [r[3][6:].split("-")])
    assert fetched < sum(f.stat().st_size for f in (local / "export" / "shards").glob("*.tar"))
