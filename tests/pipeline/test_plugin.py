"""A plug-in stage is one file (plugin_stage.py) plus one line in the DAG. Its section
is composed into the config (validated like any other, with the key named), it runs under the
runner unchanged, and its parameter enters its fingerprint."""
import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
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
