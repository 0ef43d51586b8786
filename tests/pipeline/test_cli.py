"""The command line, as a user runs it (subprocesses, in-process executor for speed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}


def vlc(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlcurate.pipeline.cli", *args], env=ENV,
                          capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.parametrize("cmd", [[], ["run"], ["check"], ["demo"], ["inspect"], ["export"], ["finetune"],
                                 ["report"]])
def test_help_everywhere(cmd):
    out = vlc(*cmd, "--help")
    assert out.returncode == 0 and "usage: vlcurate" in out.stdout


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "demo"
    res = vlc("demo", "--out", str(out), "--n", "30", "--executor", "local",
              "--set", "run.progress=false")
    assert res.returncode == 0, res.stderr[-2000:]
    return out, res


def test_demo_prints_summary_and_checks(demo_run):
    out, res = demo_run
    assert "rows in = rows kept + rows rejected for every stage, no row lost: yes" in res.stdout
    for stage in ("ingest", "ids", "embed", "export"):
        assert f"\n{stage} " in res.stdout
    assert "RANDOM weights" in res.stdout      # the demo's random image encoder is announced
    assert (out / "run" / "export" / "shards" / "sizes.json").exists()


def test_inspect_shows_reasons_with_examples_and_schemas(demo_run):
    out, _ = demo_run
    res = vlc("inspect", str(out / "run"))
    assert res.returncode == 0, res.stderr
    for text in ("ingest.truncated_image: 1", "bad-truncated", "ingest.duplicate_id: 1",
                 "schema: sample_id: string", "first 5 rows of the annotated table", "shards:"):
        assert text in res.stdout


def test_export_reexports_without_recomputing(demo_run, tmp_path):
    out, _ = demo_run
    stamp = {p: p.stat().st_mtime_ns for p in (out / "run" / "ingest" / "data").rglob("*.parquet")}
    res = vlc("export", str(out / "run"), "--out", str(tmp_path / "exp"), "--executor", "local",
              "--set", "export.samples_per_shard=2", "--set", "run.progress=false")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[ingest] up to date" in res.stdout and "[ids] up to date" in res.stdout
    sizes = json.loads((tmp_path / "exp" / "shards" / "sizes.json").read_text())
    assert max(sizes.values()) == 2
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    # the original export is untouched
    assert max(json.loads((out / "run" / "export" / "shards" / "sizes.json").read_text()).values()) > 2


def test_export_out_never_changes_what_the_run_reports(demo_run, tmp_path):
    """`export --out` records itself in its own folder; the run's run.json and summary stay as
    they were, and `inspect --export DIR` shows the other export."""
    out, _ = demo_run
    run = out / "run"
    before = {f: (run / f).read_bytes() for f in ("run.json", "summary.parquet")}
    res = vlc("export", str(run), "--out", str(tmp_path / "loose"), "--executor", "local",
              "--set", "export.drop=[ingest.*]", "--set", "run.progress=false")
    assert res.returncode == 0, res.stderr[-2000:]
    assert {f: (run / f).read_bytes() for f in before} == before
    assert (tmp_path / "loose" / "summary.parquet").exists()
    assert json.loads((tmp_path / "loose" / "run.json").read_text())["config"]["export"]["drop"] \
        == ["ingest.*"]
    own, loose = vlc("inspect", str(run)), vlc("inspect", str(run), "--export", str(tmp_path / "loose"))
    assert own.returncode == loose.returncode == 0, loose.stderr
    assert "policy drop=['ingest.*', 'lang.*'" in own.stdout
    assert "policy drop=['ingest.*']" in loose.stdout
    bad = vlc("inspect", str(run), "--export", str(tmp_path / "nothing"))
    assert bad.returncode != 0 and "not a finished export" in bad.stderr


def test_errors_are_one_clear_line(tmp_path):
    (tmp_path / "c.yaml").write_text("ingest:\n  max_pixel: 3\n")
    res = vlc("run", str(tmp_path / "c.yaml"))
    assert res.returncode == 2 and "ingest.max_pixel: unknown key (did you mean 'max_pixels'?)" in res.stderr
    assert "Traceback" not in res.stderr
    (tmp_path / "c.yaml").write_text(f"source:\n  path: {tmp_path / 'nowhere'}\n")
    res = vlc("run", str(tmp_path / "c.yaml"), "--executor", "local")
    assert res.returncode == 2 and "source.path does not exist" in res.stderr
    res = vlc("export", str(tmp_path))
    assert res.returncode == 2 and "not a vlcurate run directory" in res.stderr
