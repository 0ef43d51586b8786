"""Damaged runs: a rerun verifies every committed part against its commit record, redoes a
missing or damaged part and every downstream part that depends on it, and nothing else."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.pipeline.test_determinism import differing, snapshot
from tests.pipeline.test_runner import by_stage, cfg_for, dag_with_filter, quiet
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems

STAGES = ("ingest", "ids", "shortcap", "charcount", "export")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from vlcurate.pipeline.demo import make_demo
    return make_demo(tmp_path_factory.mktemp("dmg") / "data", n=60, seed=2)


@pytest.fixture(scope="module")
def clean(data, tmp_path_factory):
    d = tmp_path_factory.mktemp("clean") / "run"
    run(cfg_for(data, d), dag=dag_with_filter(), executor="local", log=quiet)
    return snapshot(d)


def part_files(run_dir: Path) -> dict:
    """Every committed file of every part, with its mtime."""
    return {p: p.stat().st_mtime_ns for p in run_dir.glob("*/*/part-*/*")}


def delete_file(run_dir: Path, stage: str, part: int) -> None:
    next((run_dir / stage / "data" / f"part-{part:05d}").glob("rows-*.parquet")).unlink()


def delete_dir(run_dir: Path, stage: str, part: int) -> None:
    import shutil
    shutil.rmtree(run_dir / stage / "data" / f"part-{part:05d}")


def truncate(run_dir: Path, stage: str, part: int) -> None:
    f = next((run_dir / stage / "data" / f"part-{part:05d}").glob("rows-*.parquet"))
    f.write_bytes(f.read_bytes()[:-100])


def overwrite_footer(run_dir: Path, stage: str, part: int) -> None:
    """Same size, damaged footer: only the footer read notices."""
    f = next((run_dir / stage / "data" / f"part-{part:05d}").glob("rows-*.parquet"))
    b = f.read_bytes()
    f.write_bytes(b[:-12] + b"\0" * 12)


# (damage, stage, part) -> the parts each stage must redo; a stage with a global step (ids:
# prepare) redoes every part when an upstream part is redone, and export reruns its finalize
CASES = {
    "file deleted": (delete_file, "charcount", 2, {"charcount": {2}, "export": {2}}),
    "directory deleted": (delete_dir, "shortcap", 1,
                          {"shortcap": {1}, "charcount": {1}, "export": {1}}),
    "file truncated": (truncate, "ingest", 0, {"ingest": {0}, "ids": "all", "shortcap": "all",
                                               "charcount": "all", "export": "all"}),
    "footer overwritten": (overwrite_footer, "export", 3, {"export": {3}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_part_is_redone_with_its_dependents_only(case, data, clean, tmp_path):
    damage, stage, part, expect = CASES[case]
    run_dir = tmp_path / "run"
    cfg = cfg_for(data, run_dir)
    first = by_stage(run(cfg, dag=dag_with_filter(), executor="local", log=quiet))
    n = first["ingest"].manifest["parts"]
    assert n >= 4
    damage(run_dir, stage, part)
    before = part_files(run_dir)
    res = by_stage(run(cfg, dag=dag_with_filter(), executor="local", log=quiet))
    assert not problems(list(res.values()))
    for s in STAGES:
        want = set(range(n)) if expect.get(s) == "all" else expect.get(s, set())
        assert set(res[s].redone) == want, s
        assert res[s].status == ("repaired" if want else "skipped"), s
        if want:
            assert res[s].manifest["parts_reused"] == n - len(want), s
    redone = {(s, f"part-{p:05d}") for s in STAGES for p in res[s].redone}
    untouched = {f: t for f, t in before.items()
                 if (f.parents[2].name, f.parent.name) not in redone}
    assert untouched and {f: f.stat().st_mtime_ns for f in untouched} == untouched
    assert differing(snapshot(run_dir), clean) == []
    # and the run is now sound: a third run does nothing
    assert {r.status for r in run(cfg, dag=dag_with_filter(), executor="local", log=quiet)} == \
        {"skipped"}
