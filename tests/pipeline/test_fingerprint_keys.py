"""Fingerprints hold what changes output, and only that: this pins, per stage, which config keys
enter its fingerprint. A new key must be placed on purpose (C.SPEED_ONLY for speed-only ones)."""
from __future__ import annotations

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import default_dag
from vlcurate.pipeline.runner import stage_config

OUT_EVERYWHERE = {"resources"}


def _keys(stage) -> dict[str, set[str]]:
    return {sec: set(d) for sec, d in stage_config(stage, C.Config()).items()}


def test_speed_only_settings_are_out_of_every_fingerprint():
    for node in default_dag():
        for sec, keys in _keys(node.stage).items():
            assert not keys & OUT_EVERYWHERE, (node.name, sec)
            assert not keys & set(C.SPEED_ONLY.get(sec, ())), (node.name, sec)
            assert not keys & {"out_dir"}, (node.name, sec)


def test_speed_only_keys_exist():
    for sec, names in C.SPEED_ONLY.items():
        fields = set(C.to_dict(C.Config().section(sec)))
        assert set(names) <= fields, (sec, set(names) - fields)


def test_a_speed_only_change_keeps_the_fingerprint_and_an_output_change_does_not():
    from vlcurate.pipeline.rundir import fingerprint
    from vlcurate.stages.cat.cat_stage import CatStage

    def fp(**over):
        return fingerprint("cat", CatStage.version, stage_config(CatStage, C.load(None, over)))
    base = fp()
    assert fp(**{"cat.n_process": 2, "cat.pipe_batch_size": 64, "cat.gemm": "blis"}) == base
    assert fp(**{"cat.resources": {"num_cpus": 2}}) == base
    assert fp(**{"cat.min_complexity": 2}) != base


def test_pinned_keys_per_stage():
    """What each stage's fingerprint holds, by section (update on purpose when adding a key)."""
    got = {node.name: {sec: sorted(k) for sec, k in _keys(node.stage).items()}
           for node in default_dag()}
    assert got["lang"] == {"lang": ["detector", "keep", "min_prob"]}
    assert got["cat"] == {"cat": ["if_missing", "min_complexity", "participle_actions",
                                  "require_action", "spacy_model", "title_case", "verb_nouns"]}
    assert got["textspot"] == {"textspot": [
        "backend", "det_pixels", "device", "gate", "gate_min_pixels", "gate_pixels",
        "if_missing", "keep_texts", "max_side", "max_texts", "min_chars", "min_conf", "mmocr_det",
        "mmocr_det_weights", "mmocr_rec", "mmocr_rec_weights", "mode", "precision", "runtime",
        "stop_early", "tesseract_lang", "tesseract_psm"]}
    assert got["teacher"] == {"concepts": ["teacher", "teacher_batch_size"]}   # fields it reads
    assert "decode" not in got["embed"]["embed"] and "decode_threads" not in got["embed"]["embed"]
    assert "build_threads" not in got["hpm"]["hpm"] and "k" in got["hpm"]["hpm"]
    assert {"engine", "fast"} <= set(got["hpm"]["hpm"])
    assert got["hpm"]["positives"] == ["candidates"]     # the floors its pass keeps pairs by


def test_only_the_numerics_of_the_run_section_enter_fingerprints():
    """run.image_cache / run.cache_dir (and progress, guards...) change speed or reporting only."""
    from vlcurate.pipeline.runner import _NUMERICS
    assert set(_NUMERICS) == {"chunk_rows", "intra_op_threads"}
    assert {"image_cache", "cache_dir"} <= set(C.to_dict(C.Config().run))


def test_hpm_reruns_when_the_candidate_floors_change_not_when_a_positives_threshold_does():
    """hpm's pass keeps candidate pairs by positives.candidates: they enter hpm's fingerprint;
    the positives stage's own thresholds do not."""
    from vlcurate.stages.mining.hpm_stage import HpmStage

    def hpm_config(**over):
        return stage_config(HpmStage, C.load(None, over))
    base = hpm_config()
    assert hpm_config(**{"positives.p2": 0.95, "positives.max_positives": 8}) == base
    changed = hpm_config(**{"positives.candidates.image": 0.8})
    assert changed != base and changed["positives"]["candidates"]["image"] == 0.8
    assert hpm_config(**{"hpm.engine.probe": 7})["hpm"]["engine"]["probe"] == 7
