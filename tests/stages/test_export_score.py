"""export.min_score: the cross-modal score embed writes, cut by the export policy. The real
hand-off: embed (the demo's cross model) writes cross_score, export reads it, the shards hold
exactly the pairs at or above the cut, and a new cut re-runs export alone."""
from __future__ import annotations

import json
import tarfile

import numpy as np
import pyarrow as pa
import pytest

from tests.pipeline.test_runner import by_stage, cfg_for, quiet
from vlcurate.foundation.params import ConfigError
from vlcurate.pipeline.demo import make_demo
from vlcurate.pipeline.inspect import inspect_run
from vlcurate.pipeline.report import write_report
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import reasons as R
from vlcurate.stages import score_cut

STAGES = ["ids", "embed"]


def export_rows(run_dir) -> pa.Table:
    sd = StageDir(str(run_dir), "export")
    return pa.concat_tables([sd.read(p) for p in range(sd.manifest()["parts"])])


def shard_keys(run_dir) -> set[str]:
    out = set()
    for tar in (run_dir / "export" / "shards").glob("*.tar"):
        with tarfile.open(tar) as tf:
            out |= {m.name.split(".")[0] for m in tf.getmembers() if m.name.endswith(".json")}
    return out


def test_min_score_keeps_the_pairs_at_or_above_the_cut_and_reruns_export_alone(tmp_path):
    data = make_demo(tmp_path / "data", n=40, seed=3)
    run_dir = tmp_path / "run"
    base = {"run.stages": STAGES}
    run(cfg_for(data, run_dir, **base), executor="local", log=quiet)
    before = export_rows(run_dir)
    scores = np.array([s for s in before.column(E.CROSS_SCORE.name).to_pylist() if s is not None])
    assert len(scores) > 20 and scores.std() > 0
    cut = float(np.median(scores))
    results = run(cfg_for(data, run_dir, **base, **{"export.min_score": cut}), executor="local",
                  log=quiet)
    status = {name: r.status for name, r in by_stage(results).items()}
    assert status["embed"] == "skipped" and status["export"] == "ran", status
    assert not problems(results)
    t = export_rows(run_dir).to_pylist()
    want = {r[F.SAMPLE_ID.name] for r in t if r[E.CROSS_SCORE.name] is not None
            and r[E.CROSS_SCORE.name] >= cut and not r[F.ALL_REASONS.name]}
    kept = {r[F.SAMPLE_ID.name] for r in t if r[F.KEEP.name]}
    assert kept == want and 0 < len(kept) < len(t)
    low = [r for r in t if r[E.CROSS_SCORE.name] is not None and r[E.CROSS_SCORE.name] < cut]
    assert low and all(R.LOW_CROSS_SCORE in r[F.REASONS.name] for r in low)
    assert shard_keys(run_dir) == kept
    one = next(iter((run_dir / "export" / "shards").glob("*.tar")))
    with tarfile.open(one) as tf:
        meta = json.loads(tf.extractfile(next(m for m in tf.getmembers()
                                              if m.name.endswith(".json"))).read())
    assert meta[E.CROSS_SCORE.name] >= cut


def test_min_score_without_a_cross_model_is_a_config_error(tmp_path):
    data = make_demo(tmp_path / "data", n=8, seed=3)
    cfg = cfg_for(data, tmp_path / "run", **{"run.stages": STAGES, "embed.cross_model": None,
                                             "export.min_score": 0.1})
    with pytest.raises(ConfigError, match="embed.cross_model"):
        run(cfg, executor="local", log=quiet)


def top_share(rows: list[dict], fraction: float) -> set[str]:
    """The test's own reading of keep_top_fraction: of the rows no other reason drops and that
    have a score, the first ceil(f·N) by (score desc, sample_id asc)."""
    pool = sorted((-r[E.CROSS_SCORE.name], r[F.SAMPLE_ID.name]) for r in rows
                  if r[E.CROSS_SCORE.name] is not None
                  and not set(r[F.ALL_REASONS.name]) - {R.LOW_CROSS_SCORE})
    return {sid for _, sid in pool[:int(np.ceil(round(fraction * len(pool), 9)))]}


def test_keep_top_fraction_is_exact_and_the_same_for_any_parts(tmp_path):
    # the executors and batch sizes: tests/pipeline/test_determinism.py runs with it set
    data = make_demo(tmp_path / "data", n=40, seed=3)
    over = {"run.stages": STAGES, "export.keep_top_fraction": 0.3}
    kept = {}
    for name, per_part in (("16", 16), ("7", 7)):
        run_dir = tmp_path / name
        results = run(cfg_for(data, run_dir, **over, **{"source.rows_per_part": per_part}),
                      executor="local", log=quiet)
        assert not problems(results)
        t = export_rows(run_dir).to_pylist()
        kept[name] = {r[F.SAMPLE_ID.name] for r in t if r[F.KEEP.name]}
        assert kept[name] == top_share(t, 0.3) and shard_keys(run_dir) == kept[name]
        assert all(R.LOW_CROSS_SCORE in r[F.REASONS.name] for r in t
                   if not r[F.KEEP.name] and r[E.CROSS_SCORE.name] is not None
                   and not set(r[F.ALL_REASONS.name]) - {R.LOW_CROSS_SCORE})
        shown_policy(run_dir, t, kept[name])
    assert kept["16"] == kept["7"] and len(kept["16"]) > 3
    n_parts = [StageDir(str(tmp_path / n), "export").manifest()["parts"] for n in kept]
    assert n_parts[0] != n_parts[1]


def shown_policy(run_dir, t: list[dict], kept: set[str]) -> None:
    """The shard manifest records where the cut fell; inspect and the report show it."""
    policy = json.loads((run_dir / "export" / "shards" / "manifest.json").read_text())["policy"]
    lowest = min(r[E.CROSS_SCORE.name] for r in t if r[F.SAMPLE_ID.name] in kept)
    assert policy["keep_top_fraction"] == 0.3 and policy["cut_score"] == lowest
    text = inspect_run(run_dir)
    assert f"cut at cut_score {lowest:.4f}" in text and "keep_top_fraction=0.3" in text
    page, _ = write_report(run_dir)
    assert f"export cut = {lowest:.4g}" in page.read_text()


class Parts:
    """plan_cut's ``read`` over in-memory parts: ``read(part)`` and ``read.map``."""

    def __init__(self, parts: list[pa.Table]) -> None:
        self.parts = parts

    def __call__(self, part: int) -> pa.Table:
        return self.parts[part]

    def map(self, fn, items):
        return [fn(x) for x in items]


def scored(rows: list[tuple]) -> pa.Table:
    sid, group, score, reasons = zip(*rows)
    return pa.table({F.SAMPLE_ID.name: list(sid), F.IMAGE_GROUP.name: list(group),
                     E.CROSS_SCORE.name: pa.array(score, pa.float32()),
                     F.ALL_REASONS.name: pa.array(reasons, F.ALL_REASONS.type)})


def every_row_kept(table: pa.Table) -> list[bool]:
    return [not rs for rs in table.column(F.ALL_REASONS.name).to_pylist()]


def kept_ids(parts: list[pa.Table], cuts, per_group: bool) -> set[str]:
    out = set()
    for t in parts:
        reasons = score_cut.with_top_fraction(t, [[] for _ in range(t.num_rows)], cuts, per_group)
        out |= {s for s, rs in zip(t.column(F.SAMPLE_ID.name).to_pylist(), reasons) if not rs}
    return out


def test_ties_at_the_cut_go_by_sample_id_and_image_groups_cut_each_their_own():
    rows = [("a", "g1", 0.5, []), ("b", "g1", 0.5, []), ("c", "g1", 0.5, []), ("d", "g2", 0.9, []),
            ("e", "g2", 0.1, []), ("f", "g2", None, []), ("g", "g3", 0.99, ["dedup.exact"]),
            ("h", "g3", 0.2, []), ("i", "g1", 0.7, [])]
    for split in ([rows], [rows[:4], rows[4:]], [rows[i:i + 1] for i in range(len(rows))]):
        parts = [scored(p) for p in split]
        cuts = score_cut.plan_cut(Parts(parts), len(parts), 0.5, False, every_row_kept)
        # pool: a b c d e h i (f has no score, g is dropped); ceil(0.5·7) = 4: d i, then a b of
        # the three tied at 0.5
        assert kept_ids(parts, cuts, False) == {"d", "i", "a", "b", "g"}
        cuts = score_cut.plan_cut(Parts(parts), len(parts), 0.5, True, every_row_kept)
        # g1 (a b c i): 2 of 4: i, a; g2 (d e): d; g3 (h alone): h
        assert kept_ids(parts, cuts, True) == {"i", "a", "d", "h", "g"}
    parts = [scored(rows)]
    cuts = score_cut.plan_cut(Parts(parts), 1, 0.3, False, every_row_kept)
    assert len(kept_ids(parts, cuts, False) - {"g"}) == 3     # 0.3 of 7 read as a decimal: 2.1
