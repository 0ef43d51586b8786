"""recaption and concepts through the runner (executor "local") on the demo data, downstream of
a fabricated ``cat`` stage that emits the CAT parse's object and attribute columns and flags
captions without an object: rows flagged upstream never reach either stage."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.demo import COLOURS, demo_overrides, make_demo
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F, tables
from vlcurate.schemas import cat as CS
from vlcurate.schemas import concepts as S
from vlcurate.schemas import recaption as R
from vlcurate.stages.base import Stage
from vlcurate.stages.concepts import ConceptsStage, TeacherStage
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from vlcurate.stages.recaption import RecaptionStage

NOUNS = {"circle", "circles", "square", "squares", "triangle", "triangles", "background", "sign"}
LOW = "cat.low_complexity"


class FakeCat(Stage):
    """Stands in for the CAT parse: nouns and adjectives by word list."""
    name = "cat"
    inputs = {"ingest": (F.CAPTION,)}
    output = tables.stage_table(CS.CAT_OBJECTS, CS.CAT_ATTRIBUTES)

    def __call__(self, batch: pa.Table) -> pa.Table:
        words = [c.lower().split() for c in batch.column(F.CAPTION.name).to_pylist()]
        objs = [[w for w in ws if w in NOUNS] for ws in words]
        attrs = [[w for w in ws if w in COLOURS or w == "small"] for ws in words]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         CS.CAT_OBJECTS.name: pa.array(objs, CS.CAT_OBJECTS.type),
                         CS.CAT_ATTRIBUTES.name: pa.array(attrs, CS.CAT_ATTRIBUTES.type),
                         F.REASONS.name: pa.array([[] if o else [LOW] for o in objs],
                                                  F.REASONS.type)})


def dag():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)), Node(FakeCat, after=("ids",)),
            Node(RecaptionStage, after=("cat",)), Node(TeacherStage, after=("cat",)),
            Node(ConceptsStage, after=("teacher",)),
            Node(ExportStage, after=("ingest", "ids", "cat", "recaption", "teacher", "concepts"))]


TEACHER = {"id": "vit_tiny_patch16_224", "random_init": True,
           "options": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48,
                       "num_heads": 2}}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    data = make_demo(tmp_path_factory.mktemp("demo") / "data", n=30, seed=2)
    run_dir = tmp_path_factory.mktemp("run") / "run"
    cfg = C.load(None, {**demo_overrides(data, run_dir), "source.rows_per_part": 16,
                        "run.progress": False, "export.drop": ["ingest.*", "cat.*"],
                        "recaption.model": {"id": "Salesforce/blip2-opt-2.7b", "random_init": True},
                        "recaption.max_new_tokens": 5, "recaption.batch_size": 8,
                        "concepts.teacher": TEACHER, "concepts.min_object_count": 2,
                        "concepts.min_attribute_count": 2, "concepts.min_sharedness": 1,
                        "concepts.min_visualness": 0.0, "concepts.epochs": 2,
                        "concepts.base_lr": 0.05, "concepts.batch_size": 32, "concepts.top_k": 5})
    results = run(cfg, dag=dag(), executor="local", log=lambda _: None)
    res = {r.manifest["stage"]: r for r in results}
    return res, run_dir


def table(path) -> pa.Table:
    return ds.dataset(path, format="parquet").to_table()


def test_only_kept_rows_are_computed(result):
    res, run_dir = result
    cat = res["cat"].manifest
    assert cat["reason_counts"].get(LOW, 0) > 0
    ann = table(run_dir / "export" / "data")
    flagged = [bool(r) for r in ann.column(F.ALL_REASONS.name).to_pylist()]
    for stage, col in (("recaption", R.RECAPTIONS.name), ("concepts", S.CONCEPT_OBJECT_IDS.name)):
        m = res[stage].manifest
        assert m["rows_in"] == cat["rows_kept"] and m["rows_rejected"] == 0
        got = table(run_dir / stage / "data").column(col).to_pylist()
        assert [v is None for v in got] == flagged       # nulls exactly where flagged upstream


def test_recaption_columns(result):
    res, run_dir = result
    t = table(run_dir / "recaption" / "data").to_pylist()
    done = [r for r in t if r[R.RECAPTIONS.name] is not None]
    assert done and all(len(r[R.RECAPTIONS.name]) == 5 and len(r[R.RECAPTION_FLAGS.name]) == 5
                        for r in done)
    assert all(r[R.RECAPTION_SCORES.name] == sorted(r[R.RECAPTION_SCORES.name], reverse=True)
               for r in done)
    assert all(r[R.RECAPTION_RANDOM.name] for r in done)
    assert any("RANDOM" in n for n in res["recaption"].info["notes"])


def test_concept_targets_and_vocabulary(result):
    res, run_dir = result
    vocab = pq.read_table(run_dir / "concepts" / "vocab.parquet")
    assert vocab.schema == S.CONCEPT_VOCAB
    v = vocab.to_pylist()
    objs = [r["synset"] for r in v if r["kind"] == "object"]
    atts = [r["synset"] for r in v if r["kind"] == "attribute"]
    assert {"circle.n.01", "square.n.01", "triangle.n.01"} <= set(objs)
    assert {"red.s.01", "small.a.01"} <= set(atts)
    assert all(r["visualness"] is None or 0 <= r["visualness"] <= 1
               for r in v if r["kind"] == "attribute")
    t = table(run_dir / "concepts" / "data")
    assert t.schema.field(S.CONCEPT_OBJECT_IDS.name).type == pa.list_(pa.uint16())
    assert t.schema.field(S.CONCEPT_OBJECT_PROBS.name).type == pa.list_(pa.float16())
    for ids_c, probs_c, n in ((S.CONCEPT_OBJECT_IDS, S.CONCEPT_OBJECT_PROBS, len(objs)),
                              (S.CONCEPT_ATTRIBUTE_IDS, S.CONCEPT_ATTRIBUTE_PROBS, len(atts))):
        pairs = zip(t.column(ids_c.name).to_pylist(), t.column(probs_c.name).to_pylist(),
                    strict=True)
        rows = [(i, p) for i, p in pairs if i is not None]
        assert rows and all(len(i) == len(p) == min(5, n) for i, p in rows)
        assert all(max(i) < n and len(set(i)) == len(i) for i, _ in rows)
        assert all(abs(sum(p) - 1) < 5e-3 and p == sorted(p, reverse=True) for _, p in rows)
    assert any("RANDOM" in n for n in res["concepts"].info["notes"])


def test_exported_with_the_annotations(result):
    _, run_dir = result
    ann = table(run_dir / "export" / "data")
    assert {R.RECAPTIONS.name, S.CONCEPT_OBJECT_IDS.name, S.CONCEPT_ATTRIBUTE_PROBS.name} <= \
        set(ann.column_names)
    import tarfile
    shard = min((run_dir / "export" / "shards").glob("*.tar"))
    with tarfile.open(shard) as tf:
        first = next(m for m in tf.getmembers() if m.name.endswith(".json"))
        meta = json.load(tf.extractfile(first))
    assert len(meta[R.RECAPTIONS.name]) == 5
    assert np.isclose(sum(meta[S.CONCEPT_OBJECT_PROBS.name]), 1, atol=5e-3)


# --- an empty vocabulary stops the run with the key to lower, or says so ----------------------
def real_cat_dag():
    from vlcurate.stages.cat.cat_stage import CatStage
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)), Node(CatStage, after=("ids",)),
            Node(TeacherStage, after=("cat",)), Node(ConceptsStage, after=("teacher",)),
            Node(ExportStage, after=("ingest", "ids", "cat", "teacher", "concepts"))]


@pytest.fixture(scope="module")
def demo20(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo") / "data", n=20, seed=3)


def small_cfg(data, run_dir, **over) -> C.Config:
    # the real CAT parse (cat.spacy_model=auto) writes the words concepts reads
    return C.load(None, {**demo_overrides(data, run_dir), "run.progress": False,
                         "concepts.teacher": TEACHER, "concepts.epochs": 1,
                         "concepts.min_visualness": None, **over})


def test_an_empty_attribute_vocabulary_stops_the_run_naming_the_key(demo20, tmp_path):
    from vlcurate.stages.concepts.stage import EmptyVocabulary
    with pytest.raises(EmptyVocabulary) as e:      # DiHT's LAION-scale default on ~10 images
        run(small_cfg(demo20, tmp_path / "a", **{"concepts.min_attribute_count": 250}),
            dag=real_cat_dag(), executor="local", log=lambda _: None)
    msg = str(e.value)
    assert msg.startswith("concepts: empty attribute vocabulary over ") and \
        "concepts.min_attribute_count=250" in msg and "concepts.if_empty: warn" in msg
    assert isinstance(e.value, C.ConfigError)       # the CLI prints it as one line, exit 2
    with pytest.raises(EmptyVocabulary, match=r"concepts\.min_object_count=250"):
        run(small_cfg(demo20, tmp_path / "b", **{"concepts.min_object_count": 250}),
            dag=real_cat_dag(), executor="local", log=lambda _: None)


def test_if_empty_warn_runs_on_and_the_summary_says_so(demo20, tmp_path):
    from vlcurate.pipeline.summary import format_summary
    results = run(small_cfg(demo20, tmp_path / "run", **{"concepts.min_attribute_count": 250,
                                                          "concepts.if_empty": "warn"}),
                  dag=real_cat_dag(), executor="local", log=lambda _: None)
    res = {r.manifest["stage"]: r for r in results}
    note = next(n for n in res["concepts"].info["notes"] if "empty attribute" in n)
    assert "concepts.min_attribute_count=250" in note and "if_empty: warn" in note
    assert note in format_summary(results)
    t = table(tmp_path / "run" / "concepts" / "data").to_pylist()
    done = [r for r in t if r[S.CONCEPT_OBJECT_IDS.name] is not None]
    assert done and all(r[S.CONCEPT_OBJECT_IDS.name] for r in done)   # objects still learnt
    assert all(r[S.CONCEPT_ATTRIBUTE_IDS.name] == [] for r in done)
    # the same run with the demo's thresholds has both vocabularies, and no such note
    results = run(small_cfg(demo20, tmp_path / "ok"), dag=real_cat_dag(), executor="local",
                  log=lambda _: None)
    res = {r.manifest["stage"]: r for r in results}
    assert not any("empty" in n for n in res["concepts"].info.get("notes", []))
    kinds = pq.read_table(tmp_path / "ok" / "concepts" / "vocab.parquet").column("kind")
    assert set(kinds.to_pylist()) == {"object", "attribute"}
