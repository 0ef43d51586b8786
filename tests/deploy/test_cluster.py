"""The cluster path for real: a multi-process Ray cluster on loopback (a head and a second node,
started with `ray start` by deploy/local_cluster.sh), the demo submitted to it with
`ray job submit --working-dir`, its outputs checked, a resubmission through deploy/submit.sh
that resumes (every stage up to date), and every process of the cluster stopped afterwards.

The commands are the ones in the README's "Run on a cluster": both come from
deploy/local_cluster.sh. The test never runs `ray stop` (that would stop every Ray on the
machine); it stops the processes carrying this cluster's marker, and checks none is left.
"""
from __future__ import annotations

import io
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from vlcurate.pipeline.dag import default_dag
from vlcurate.pipeline.rundir import StageDir
from vlcurate.schemas import F
from vlcurate.schemas import recaption as R

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "deploy" / "local_cluster.sh"
SUBMIT = REPO / "deploy" / "submit.sh"
MARK = "VLCURATE_LOCAL_CLUSTER"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")]


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", MARK)}
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"  # ray, vlcurate
    e["RAY_AUTH_MODE"] = "disabled"
    e["RAY_USAGE_STATS_ENABLED"] = "0"
    return e


def marked(cluster_dir: Path) -> list[int]:
    """Processes whose environment carries this cluster's marker (as the script finds them)."""
    want = f"{MARK}={cluster_dir}".encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if want in (p / "environ").read_bytes().split(b"\0"):
                out.append(int(p.name))
        except OSError:
            pass
    return out


def sh(*args, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], env=env(), timeout=timeout, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture
def cluster():
    # short: Ray's unix socket paths under the temp dir must stay under 108 bytes
    d = Path(tempfile.mkdtemp(prefix="vlcc-", dir="/tmp"))
    down = None
    try:
        up = sh(CLUSTER, "up", d, timeout=240)
        assert up.returncode == 0, up.stdout[-4000:]
        info = dict(line.split("=", 1) for line in (d / "cluster.env").read_text().split())
        yield d, info
    finally:
        try:
            down = sh(CLUSTER, "down", d, timeout=90)
        except subprocess.TimeoutExpired:
            pass
        left = marked(d)
        for pid in left:  # last resort, and the test then fails below
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)
        assert down is not None and down.returncode == 0, down and down.stdout
        assert not left, f"processes of the cluster left after `down`: {left}"


def test_demo_job_on_a_two_node_cluster_with_its_run_directory_in_a_bucket(s3, cluster, tmp_path):
    """The demo job on two nodes with ``run.run_dir`` in a bucket (a real S3 HTTP API on
    loopback; the cluster's processes get the endpoint and credentials from the standard AWS
    environment): no shared folder for the run, every stage committed in the bucket; then
    deploy/submit.sh resubmits it and every stage is up to date."""
    d, info = cluster
    from ray.util.state import list_jobs, list_nodes, list_tasks
    from vlcurate.foundation import storage
    dash = info["DASHBOARD"]
    assert dash.startswith("http://127.0.0.1:")
    nodes = [n for n in list_nodes(address=dash) if n.state == "ALIVE"]
    assert sorted(n.resources_total["CPU"] for n in nodes) == [1.0, 2.0]
    assert marked(d), "the cluster's processes carry the marker"

    out, run_dir = tmp_path / "demo", f"{s3.bucket()}/runs/demo"
    t0 = time.time()
    job = sh(CLUSTER, "submit", d, "--", "vlcurate", "demo", "--out", out, "--n", "40",
             "--set", "source.rows_per_part=16", "--set", f"run.run_dir={run_dir}", timeout=900)
    took = time.time() - t0
    assert job.returncode == 0, job.stdout[-6000:]
    assert "succeeded" in job.stdout
    assert "no row lost: yes" in job.stdout
    assert not (out / "run").exists(), "nothing of the run on local disk"

    # --- the outputs: summary, manifests, tables, shards --------------------------------------
    run = storage.read_json(f"{run_dir}/run.json")
    summary = pq.read_table(io.BytesIO(storage.read_bytes(f"{run_dir}/summary.parquet")))
    summary = summary.to_pylist()
    assert [r["stage"] for r in summary] == run["dag"]
    n_records = len((out / "data" / "captions.csv").read_bytes().splitlines()) - 1
    n_parts = math.ceil(n_records / 16)
    for row in summary:
        m = storage.read_json(f"{run_dir}/{row['stage']}/_manifest.json")
        assert m["status"] == "complete" and m["fingerprint"] == row["fingerprint"]
        assert m["rows"] == n_records                               # co-partitioned: every row
        assert m["rows_in"] == m["rows_kept"] + m["rows_rejected"]
        assert m["parts"] == n_parts
        assert StageDir(run_dir, row["stage"]).committed() == list(range(n_parts))
    m = {row["stage"]: storage.read_json(f"{run_dir}/{row['stage']}/_manifest.json")
         for row in summary}
    assert list(m) == [n.name for n in default_dag()]       # every stage, in the DAG's order
    assert m["embed"]["rows_in"] == m["textspot"]["rows_kept"] == m["hpm"]["rows_in"]
    assert m["recaption"]["rows_in"] == m["positives"]["rows_kept"] == m["hpm"]["rows_kept"]
    assert m["dedup"]["rows_in"] == m["positives"]["rows_kept"]
    # the teacher runs beside dedup, so a twin dedup flags still gets its concept targets
    assert m["concepts"]["rows_in"] == m["teacher"]["rows_in"] == m["dedup"]["rows_in"]
    # the demo's policy drops no dedup.* reason: the twins dedup flags are exported too
    assert m["dedup"]["rows_rejected"] > 0
    assert m["export"]["rows_kept"] == m["dedup"]["rows_kept"] + m["dedup"]["rows_rejected"]
    ann = StageDir(run_dir, "export").read_all([F.KEEP.name, R.RECAPTIONS.name])
    kept = ann.filter(ann.column(F.KEEP.name))
    assert kept.num_rows == m["export"]["rows_kept"] > 0
    assert all(len(r) == 5 for r in kept.column(R.RECAPTIONS.name).to_pylist())   # BLIP-2's 5 beams
    ingest = m["ingest"]
    assert set(ingest["reason_counts"]) == {
        "ingest.missing_file", "ingest.truncated_image", "ingest.undecodable_image",
        "ingest.zero_byte", "ingest.empty_caption", "ingest.non_utf8_caption"}
    ids = storage.read_json(f"{run_dir}/ids/_manifest.json")
    assert ids["reason_counts"] == {"ingest.duplicate_id": 1}
    export = storage.read_json(f"{run_dir}/export/_manifest.json")
    shards = storage.read_json(f"{run_dir}/export/shards/manifest.json")
    sizes = storage.read_json(f"{run_dir}/export/shards/sizes.json")
    assert shards["samples"] == export["rows_kept"] == sum(sizes.values()) > 0
    members = 0
    for f in shards["files"]:
        data = storage.read_bytes(f"{run_dir}/export/shards/{f['shard']}")
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            names = tf.getnames()
        members += len(names)
        assert {n.rsplit(".", 1)[1] for n in names} == {"jpg", "txt", "json"}
        assert len(names) == 3 * f["samples"]
    assert members == 3 * shards["samples"]

    # --- it ran on the cluster, on both nodes ------------------------------------------------
    jobs = [j for j in list_jobs(address=dash) if "vlcurate demo" in j.entrypoint]
    assert [j.status for j in jobs] == ["SUCCEEDED"]
    tasks = list_tasks(address=dash, detail=True, limit=10000, raise_on_missing_output=False,
                       filters=[("state", "=", "FINISHED")])
    used = {t.node_id for t in tasks}
    assert {n.node_id for n in nodes} <= used, "both nodes ran tasks of the job"

    # --- deploy/submit.sh: the same run again resumes, every stage up to date -----------------
    wd = tmp_path / "submit"     # the job's working dir: uploaded, holds the config
    wd.mkdir()
    (wd / "again.yaml").write_text(yaml.safe_dump(run["config"]))
    again = subprocess.run([str(SUBMIT), "again.yaml"], cwd=wd, timeout=600, text=True,
                           env={**env(), "RAY_ADDRESS": dash}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    assert again.returncode == 0, again.stdout[-4000:]
    for stage in run["dag"]:
        assert f"[{stage}] up to date" in again.stdout
    print(f"demo job on the 2-node cluster: {took:.0f}s")
