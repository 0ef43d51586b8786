"""A hostile folder through the whole runner (ingest -> ids -> export, in-process executor), and
an empty or wrong source through the command line: one clean error line, before any stage."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml

from . import hostile
from .hostile import good
from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F
from vlcurate.schemas import reasons as R
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage

pytestmark = pytest.mark.timeout(120)


def _hostile_folder(root: Path, outside: Path) -> tuple[list[dict], list[bytes]]:
    recs = [good(f"g{i}", i) for i in range(4)]
    recs += [dict(good("fifo", 5), image=None, special="fifo", expect=[R.SPECIAL_FILE]),
             dict(good("esc", 6), image=None, special=f"symlink:{outside}",
                  expect=[R.OUTSIDE_SOURCE]),
             dict(good("big", 7), image=b"\xff" * 30_000, expect=[R.FILE_TOO_LARGE]),
             dict(good("zw", 8), caption="\u200b\u2060".encode(), expect=[R.EMPTY_CAPTION]),
             dict(good("g0", 9), expect=[R.DUPLICATE_ID])]          # the same key again
    recs[-1]["name"] = "g0-again.jpg"
    lines = [b'q,g1.jpg,"an unbalanced quote\n', b"r,g1.jpg,ragged,row\n",
             b"after,g2.jpg,still a record\n"]
    hostile.write("csv", root, recs, extra_lines=lines)
    return recs, lines


def test_a_hostile_folder_through_the_runner_balances_every_stage(tmp_path):
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(hostile.corpus.jpeg(32, 24, seed=1))
    recs, lines = _hostile_folder(tmp_path / "src", outside)
    cfg = C.load(None, {"source.path": str(tmp_path / "src"), "source.key_column": "key",
                        "source.captions_file": "captions.csv", "source.rows_per_part": 4,
                        "source.max_image_bytes": 20_000, "run.run_dir": str(tmp_path / "run"),
                        "run.progress": False})
    dag = [Node(IngestStage), Node(IdsStage, after=("ingest",)),
           Node(ExportStage, after=("ingest", "ids"))]
    res = {r.manifest["stage"]: r.manifest for r in run(cfg, dag, "local", log=lambda _: None)}
    n = len(recs) + len(lines)                                      # what the source holds
    assert res["ingest"]["rows_in"] == n and res["ingest"]["rows_rejected"] == 6
    for m in res.values():     # (ids sees the rows ingest kept)
        assert m["rows_in"] == m["rows_kept"] + m["rows_rejected"], m
    assert res["ids"]["rows_in"] == n - 6 and res["ids"]["rows_rejected"] == 1
    assert res["export"]["rows_kept"] == len({"g0", "g1", "g2", "g3", "after"})
    samples = ds.dataset(tmp_path / "run" / "ingest" / "data", format="parquet").to_table()
    samples = samples.to_pylist()
    got = {r[F.KEY.name]: r[F.REASONS.name] for r in samples if r[F.KEY.name] != "g0"
           or r[F.IMAGE_REF.name] == "g0-again.jpg"}
    assert got["fifo"] == [R.SPECIAL_FILE] and got["esc"] == [R.OUTSIDE_SOURCE]
    assert got["big"] == [R.FILE_TOO_LARGE] and got["zw"] == [R.EMPTY_CAPTION]
    assert got["q"] == got["r"] == [R.BAD_RECORD, R.MISSING_CAPTION]   # their own keys
    assert got["after"] == []
    ids = ds.dataset(tmp_path / "run" / "ids" / "data", format="parquet").to_table()
    assert ids.column(F.REASONS.name).to_pylist().count([R.DUPLICATE_ID]) == 1


@pytest.mark.parametrize("what,message", [
    ("empty", "no records (an empty captions file)"),
    ("wrong", "no .tar / .tar.gz / .tgz shards in"),
])
def test_the_cli_reports_an_empty_or_wrong_source_as_one_line(tmp_path, what, message):
    src = tmp_path / "src"
    src.mkdir()
    if what == "empty":
        (src / "captions.csv").write_bytes(b"\xef\xbb\xbfimage,caption\n\n")
        kind = "folder"
    else:
        hostile.write("parquet", src, [good("g0", 0)])
        kind = "webdataset"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"source": {"kind": kind, "path": str(src)},
                                      "run": {"run_dir": str(tmp_path / "run"),
                                              "progress": False, "stages": ["ids"]}}))
    out = subprocess.run([sys.executable, "-m", "vlcurate.pipeline.cli", "run", str(config),
                          "--executor", "local"], capture_output=True, text=True, timeout=100,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()   # the preflight's report: the source's one line
    assert lines[0] == "preflight found problems; nothing has run yet:", out.stderr
    assert len(lines) == 2 and lines[1].startswith("  - source: ") and message in lines[1]
    assert not (tmp_path / "run" / "ingest" / "_manifest.json").exists()
