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
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import reasons as R

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
