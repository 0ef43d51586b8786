"""Loud guards: a stage flagging almost everything warns (console and summary) with its top
reason and the setting to turn; run.max_reject_fraction turns that into a stop."""
from __future__ import annotations

import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.guards import knob, warning
from vlcurate.pipeline.runner import RunError, run
from vlcurate.pipeline.summary import format_summary


def _m(stage, rows_in, rejected, reasons):
    return {"stage": stage, "rows_in": rows_in, "rows_rejected": rejected,
            "rows_kept": rows_in - rejected, "reason_counts": reasons}


def test_warning_names_the_top_reason_and_the_knob():
    m = _m("hpm", 40, 38, {"hpm.noise_pair": 38})
    assert warning(m, 0.9) == ("hpm flagged 38 of the 40 rows it saw (95%; expected at most 50%); "
                               "top reason hpm.noise_pair (38 rows): check hpm.k (a row needs k "
                               "supporting pairs: a small set needs a small k), hpm.tau_image / "
                               "hpm.tau_text (similarities at or below them count as 0), or "
                               "hpm.noise_action=mark to keep the rows and only mark them")
    assert warning(_m("hpm", 40, 20, {"hpm.noise_pair": 20}), 0.9) is None    # 50%: not above
    assert warning(_m("hpm", 0, 0, {}), 0.9) is None
    assert warning(_m("export", 40, 40, {"cat.no_action": 40}), 0.9) is None  # export: the policy
    assert knob("ingest.zero_byte").startswith("the source settings (source.path")


def test_each_filter_warns_above_its_own_expected_share():
    """Language ID above 20% of a set (the grocery photos: 45% of product names read as another
    language) warns, where the old single 90% guard was silent; a plug-in stage without an
    expected share keeps run.warn_reject_fraction."""
    lang = warning(_m("lang", 100, 45, {"lang.other": 45}), 0.9)
    assert lang.startswith("lang flagged 45 of the 100 rows it saw (45%; expected at most 20%)")
    assert "lang.keep" in lang and "lang.min_prob" in lang
    assert warning(_m("lang", 100, 19, {"lang.other": 19}), 0.9) is None
    assert warning(_m("dedup", 100, 94, {"dedup.near_duplicate": 94}), 0.9).endswith(
        "check hpm.dup_threshold (S_ii or S_tt above it is a duplicate), positives.duplicates="
        "false, or export.drop without dedup.near_duplicate to export every copy")
    assert warning(_m("myplugin", 100, 80, {"myplugin.blurry": 80}), 0.9) is None
    plug = warning(_m("myplugin", 100, 95, {"myplugin.blurry": 95}), 0.9)
    assert plug.endswith("check the myplugin.* settings, or export.drop without myplugin.blurry "
                         "to export these rows")
    assert warning(_m("lang", 100, 15, {"lang.other": 15}), 0.1) is not None  # a lower global one


@pytest.mark.parametrize("reason, settings", [
    ("cat.low_complexity", ["cat.min_complexity", "cat.title_case"]),
    ("cat.no_action", ["cat.require_action", "cat.title_case", "cat.participle_actions"]),
    ("hpm.noise_pair", ["hpm.k", "hpm.tau_image", "hpm.tau_text", "hpm.noise_action"]),
    ("dedup.near_duplicate", ["hpm.dup_threshold", "positives.duplicates", "export.drop"]),
    ("lang.other", ["lang.keep", "lang.min_prob"]),
    ("cat.text_spotted", ["textspot.min_chars", "textspot.min_conf"]),
])
def test_every_warning_names_every_setting_that_changes_its_decision(reason, settings):
    from vlcurate.pipeline import config as C
    text = knob(reason)
    assert "this stage's thresholds" not in text
    cfg = C.load(None, {})
    for key in settings:             # each named setting is a real key of the config
        assert key in text, (reason, key)
        section, name = key.split(".")
        assert hasattr(cfg.section(section), name), key


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("guards") / "data", n=30, seed=2)


def _cfg(data, run_dir, **over):
    return C.load(None, {**demo_overrides(data, run_dir), "run.progress": False,
                         "run.stages": ["ids", "lang"], **over})


def test_a_stage_that_rejects_nearly_everything_warns(demo_data, tmp_path):
    logs: list[str] = []
    cfg = _cfg(demo_data, tmp_path / "r", **{"lang.keep": ["fr"]})
    res = run(cfg, executor="local", log=logs.append)
    warn = [line for line in logs if "WARNING" in line]
    assert len(warn) == 1 and warn[0].startswith("[lang] WARNING: lang flagged ")
    assert "top reason lang.other" in warn[0] and "check lang.keep" in warn[0]
    summary = format_summary(res)
    assert "\nWARNING:\n  * lang flagged " in summary
    # an up-to-date rerun still says it
    again = run(cfg, executor="local", log=lambda _: None)
    assert "\nWARNING:\n  * lang flagged " in format_summary(again)


def test_max_reject_fraction_stops_the_run_after_the_stage(demo_data, tmp_path):
    cfg = _cfg(demo_data, tmp_path / "r", **{"lang.keep": ["fr"], "run.max_reject_fraction": 0.5})
    with pytest.raises(RunError, match=r"lang flagged .* The run stops here because "
                                       r"run.max_reject_fraction is 0.5"):
        run(cfg, executor="local", log=lambda _: None)
    assert (tmp_path / "r" / "lang" / "_manifest.json").exists()     # the stage is committed
    assert not (tmp_path / "r" / "export" / "_manifest.json").exists()


def test_a_sensible_run_is_quiet(demo_data, tmp_path):
    logs: list[str] = []
    res = run(_cfg(demo_data, tmp_path / "r"), executor="local", log=logs.append)
    assert not [line for line in logs if "WARNING" in line]
    assert "WARNING" not in format_summary(res)


def test_stages_with_no_row_left_finish_at_once_without_running(demo_data, tmp_path,
                                                               monkeypatch):
    """Nothing survives `lang` (keep: fr): embed then writes null columns for every row without
    building its encoders, and the books still balance."""
    from vlcurate.pipeline.summary import problems
    from vlcurate.schemas import embed as E
    import pyarrow.dataset as ds
    from vlcurate.stages.embed import EmbedStage

    def never(self):
        raise AssertionError("embed was set up although no row is left to compute")

    monkeypatch.setattr(EmbedStage, "setup", never)
    logs: list[str] = []
    cfg = _cfg(demo_data, tmp_path / "r", **{"lang.keep": ["xx"], "lang.min_prob": 1.0,
                                              "run.stages": ["ids", "lang", "embed"]})
    res = run(cfg, executor="local", log=logs.append)
    assert "[embed] no row is left to compute: null columns written, stage not run" in logs
    m = {r.manifest["stage"]: r.manifest for r in res}
    assert m["lang"]["rows_kept"] == 0 and m["embed"]["rows_in"] == 0
    assert m["embed"]["rows"] == m["ingest"]["rows"] and not problems(res)
    emb = ds.dataset(tmp_path / "r" / "embed" / "data", format="parquet").to_table()
    assert emb.num_rows == m["ingest"]["rows"]
    assert emb.column(E.IMAGE_EMB_NAME).null_count == emb.num_rows
