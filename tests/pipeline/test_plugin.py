"""A plug-in stage is one file (plugin_stage.py) plus one line in the DAG. Its section
is composed into the config (validated like any other, with the key named), it runs under the
runner unchanged, and its parameter enters its fingerprint. Its preflight check, expected share
and knobs reach the preflight and the guards as a built-in stage's do."""
import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.guards import empty_export, knob, warning
from vlcurate.pipeline.preflight import preflight, problems
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.runner import run
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage

from .plugin_stage import TOO_SHORT, WordCountStage


def plugin_dag():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(WordCountStage, after=("ids",)),          # the one line
            Node(ExportStage)]                                   # a sink: after all of them


def test_a_plugin_stage_runs_with_its_own_section(tmp_path):
    data = make_demo(tmp_path / "data", n=30, seed=2)
    over = {**demo_overrides(data, tmp_path / "run"), "run.progress": False, "export.drop": ["*"]}
    results = {}
    for min_words in (3, 9):
        cfg = C.load(None, {**over, "wordcount.min_words": min_words}, dag=plugin_dag())
        assert cfg.wordcount.min_words == min_words
        logs: list[str] = []
        out = {r.manifest["stage"]: r for r in run(cfg, plugin_dag(), executor="local",
                                                   log=logs.append)}
        results[min_words] = out
        m = out["wordcount"].manifest
        assert m["rows_in"] == m["rows_kept"] + m["rows_rejected"]
    # the parameter changed the output, reran the stage and export, and nothing upstream
    assert results[9]["wordcount"].manifest["rows_rejected"] > \
        results[3]["wordcount"].manifest["rows_rejected"]
    assert results[9]["wordcount"].manifest["reason_counts"][TOO_SHORT] > 0
    assert results[9]["wordcount"].status == "ran" and results[9]["ingest"].status == "skipped"
    assert any(x.startswith("[wordcount] recomputing: its config") for x in logs)  # said why
    assert results[9]["export"].manifest["rows_kept"] < results[3]["export"].manifest["rows_kept"]


def test_its_section_is_checked_like_any_other():
    with pytest.raises(C.ConfigError, match=r"wordcount\.min_words: must be an int > 0"):
        C.load(None, {"wordcount.min_words": 0}, dag=plugin_dag())
    with pytest.raises(C.ConfigError, match=r"wordcount\.min_word: unknown key \(did you mean "):
        C.load(None, {"wordcount.min_word": 2}, dag=plugin_dag())
    with pytest.raises(C.ConfigError, match=r"wordcount: unknown key"):
        C.load(None, {"wordcount.min_words": 2})          # the default DAG has no such stage


def test_its_preflight_hook_expected_share_and_knobs_are_used(tmp_path):
    data = make_demo(tmp_path / "data", n=8, seed=2)
    over = demo_overrides(data, tmp_path / "run")
    names = [n.name for n in plugin_dag()]
    ok = C.load(None, over, dag=plugin_dag())
    assert "wordcount.min_words: 3" in [f.text for f in preflight(ok, names, plugin_dag())]
    bad = C.load(None, {**over, "wordcount.min_words": 40}, dag=plugin_dag())
    assert problems(preflight(bad, names, plugin_dag())) == [
        "wordcount.min_words = 40 flags almost every caption: set it to 20 or less"]
    assert problems(preflight(bad, [n for n in names if n != "wordcount"], plugin_dag())) == []
    m = {"stage": "wordcount", "rows_in": 100, "rows_kept": 70, "rows_rejected": 30,
         "reason_counts": {TOO_SHORT: 30}}
    assert warning(m, 0.9) is None            # the default DAG knows no wordcount: 90%
    assert warning(m, 0.9, plugin_dag()) == (
        "wordcount flagged 30 of the 100 rows it saw (30%; expected at most 25%); top reason "
        "wordcount.too_short (30 rows): check wordcount.min_words (the fewest words a caption "
        "may have)")
    assert knob(TOO_SHORT).startswith("the wordcount.* settings")
    export = {"stage": "export", "rows_in": 9, "rows_kept": 0, "rows_rejected": 9,
              "reason_counts": {TOO_SHORT: 9}}
    assert "wordcount.too_short: 9 rows; check wordcount.min_words" in \
        empty_export([export], ["*"], dag=plugin_dag())
