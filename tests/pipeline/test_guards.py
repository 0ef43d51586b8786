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
    assert warning(m, 0.9) == ("hpm flagged 38 of the 40 rows it saw (95%); top reason "
                               "hpm.noise_pair (38 rows): check hpm.k (a row needs k supporting "
                               "pairs: a small set needs a small k), or hpm.noise_action=mark to "
                               "keep the rows and only mark them")
    assert warning(_m("hpm", 40, 36, {"hpm.noise_pair": 36}), 0.9) is None    # 90%: not above
    assert warning(_m("hpm", 0, 0, {}), 0.9) is None
    assert warning(_m("export", 40, 40, {"cat.no_action": 40}), 0.9) is None  # export applies policy
    assert knob("ingest.zero_byte").startswith("the source settings")
    assert knob("someplugin.thing") == "this stage's thresholds"


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
