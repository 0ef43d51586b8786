"""The committed kept mask: each stage's commit record holds its rows' flag levels after it and
its ancestors, and a downstream stage reads its frontier's levels instead of every ancestor's
reasons. Checked against the reasons themselves, on a run with a filter in a chain."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.pipeline.test_runner import cfg_for, dag_with_filter, demo_data, quiet  # noqa: F401
from vlcurate.pipeline import parts
from vlcurate.pipeline.dag import frontier
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import Runner, run
from vlcurate.schemas import F

STAGES = ("ingest", "ids", "shortcap", "charcount")


@pytest.fixture(scope="module")
def finished(demo_data, tmp_path_factory):  # noqa: F811
    cfg = cfg_for(demo_data, tmp_path_factory.mktemp("mask") / "run")
    run(cfg, dag=dag_with_filter(), executor="local", log=quiet)
    return cfg


def _io(cfg, name: str) -> parts.PartIO:
    runner = Runner(cfg, dag=dag_with_filter(), executor="local", log=quiet)
    return runner.part_io(next(n for n in runner.dag if n.name == name), None)[0]


def _naive_levels(cfg, names, part: int) -> np.ndarray:
    """The highest level any of these stages' committed reasons gives each row."""
    out = None
    for name in names:
        rs = StageDir(cfg.run.run_dir, name).read(part, [F.REASONS.name]).column(0).to_pylist()
        lv = parts.flag_levels(rs)
        out = lv if out is None else np.maximum(out, lv)
    return out


def test_frontier_is_the_ancestors_no_other_ancestor_descends_from():
    dag = dag_with_filter()
    assert frontier(dag, ("ingest", "ids", "shortcap")) == ("shortcap",)
    assert frontier(dag, ("ingest", "ids", "shortcap", "charcount")) == ("charcount",)
    assert frontier(dag, ("ingest",)) == ("ingest",)


def test_each_record_holds_the_levels_of_its_stage_and_every_ancestor(finished):
    n_parts = len(StageDir(finished.run.run_dir, "ingest").committed())
    assert n_parts > 1
    for i, name in enumerate(STAGES):
        for p in range(n_parts):
            rec = StageDir(finished.run.run_dir, name).record(p)
            got = parts.unpack_levels(rec[F.MK.FLAG_LEVELS])
            assert got.tolist() == _naive_levels(finished, STAGES[:i + 1], p).tolist(), (name, p)
    last = parts.unpack_levels(StageDir(finished.run.run_dir, "charcount").record(0)[
        F.MK.FLAG_LEVELS])
    assert {0, 1} <= set(last.tolist())          # the demo has kept rows and short captions


def test_a_stage_reads_one_record_for_the_mask_and_only_the_columns_it_needs(finished,
                                                                               monkeypatch):
    io = _io(finished, "charcount")
    reads = []
    real = StageDir.read

    def spy(self, part, columns=None, kind="data"):
        reads.append((self.name, tuple(columns or ())))
        return real(self, part, columns, kind)

    monkeypatch.setattr(StageDir, "read", spy)
    fast = parts.read_inputs(io, 0)
    assert reads == [("ingest", (F.SAMPLE_ID.name, F.CAPTION.name))]
    # the same part read the old way (records without levels): every ancestor's reasons
    reads.clear()
    monkeypatch.setattr(parts, "_committed_levels", lambda io, part: None)
    slow = parts.read_inputs(io, 0)
    assert [r[0] for r in reads] == ["ingest", "ids", "shortcap"]
    assert fast.equals(slow)
    active = fast.column(F.ACTIVE.name).to_pylist()
    assert active == (_naive_levels(finished, STAGES[:3], 0) == 0).tolist() and not all(active)


def test_compute_on_flagged_reads_flagged_rows_but_never_ingest_rejects(finished):
    io = _io(finished.replace(**{"run.compute_on_flagged": True}), "charcount")
    t = parts.read_inputs(io, 0)
    levels = np.array(t.column(F.FLAG_LEVEL.name).to_pylist())
    assert t.column(F.ACTIVE.name).to_pylist() == (levels < parts.MANDATORY).tolist()


def test_a_record_without_levels_is_read_the_old_way(finished, tmp_path):
    import shutil
    old = tmp_path / "old"
    shutil.copytree(finished.run.run_dir, old)
    for rec in old.glob("*/_commit/part-*.json"):
        d = json.loads(rec.read_text())
        d.pop(F.MK.FLAG_LEVELS)
        rec.write_text(json.dumps(d))
    cfg = finished.replace(**{"run.run_dir": str(old)})
    assert parts.read_inputs(_io(cfg, "charcount"), 1).equals(
        parts.read_inputs(_io(finished, "charcount"), 1))
