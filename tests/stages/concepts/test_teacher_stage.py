"""The teacher stage (features per part, on actors) and the concepts stage's bounded training
sample: what each reads, what enters their fingerprints, and that the sample does not depend
on how the rows are split into parts."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.runner import build_stage, stage_config
from vlcurate.schemas import F
from vlcurate.schemas import concepts as S
from vlcurate.stages.concepts import ConceptsStage, TeacherStage
from vlcurate.stages.concepts.stage import training_sample
from vlcurate.stages.concepts.teacher import Teacher
from tests.stages import corpus

TINY = {"id": "vit_tiny_patch16_224", "random_init": True,
        "options": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}}


def test_the_teacher_reads_only_its_two_fields_of_the_concepts_section():
    cfg = C.load(None, {"concepts.teacher": TINY})
    base = stage_config(TeacherStage, cfg)
    assert base == {"concepts": {"teacher": C.to_dict(cfg.concepts.teacher),
                                 "teacher_batch_size": 64}}
    assert stage_config(TeacherStage, cfg.replace(**{"concepts.min_object_count": 3,
                                                     "concepts.train_rows": 10})) == base
    assert stage_config(TeacherStage, cfg.replace(**{"concepts.teacher_batch_size": 8})) != base
    assert "train_rows" in stage_config(ConceptsStage, cfg)["concepts"]


def test_teacher_features_equal_the_teacher_run_directly():
    cfg = C.load(None, {"concepts.teacher": TINY})
    stage = build_stage(TeacherStage, cfg)
    images = [corpus.jpeg(seed=i) for i in (0, 1, 0, 2)]        # one image shown twice
    out = stage(pa.table({F.SAMPLE_ID.name: list("abcd"), F.IMAGE.name: images}))
    col = out.column(S.TEACHER_FEATURES_NAME).combine_chunks()
    assert col.type.list_size == 48 == stage.schema.field(S.TEACHER_FEATURES_NAME).type.list_size
    got = np.asarray(col.flatten()).reshape(4, 48)
    want = Teacher(cfg.concepts.teacher).encode(images, 64).astype(np.float16)
    assert np.array_equal(got, want) and np.array_equal(got[0], got[2])
    assert out.column(S.CONCEPT_RANDOM.name).to_pylist() == [True] * 4


def test_decode_threads_change_no_feature_and_no_fingerprint(monkeypatch):
    """teacher.decode_threads (the actor decodes ahead of the model) reaches the teacher and is
    speed only: the same features, byte for byte, and the same stage config."""
    used, encode = [], Teacher.encode
    monkeypatch.setattr(Teacher, "encode", lambda self, ims, size, threads=0:
                        used.append(threads) or encode(self, ims, size, threads))
    cfg = C.load(None, {"concepts.teacher": TINY, "teacher.decode_threads": 0})
    images = [corpus.jpeg(seed=i) for i in range(7)]
    batch = pa.table({F.SAMPLE_ID.name: [str(i) for i in range(7)], F.IMAGE.name: images})
    outs = []
    for threads in (0, 3):
        c = cfg.replace(**{"teacher.decode_threads": threads})
        assert stage_config(TeacherStage, c) == stage_config(TeacherStage, cfg)
        stage = build_stage(TeacherStage, c)
        assert stage.config.teacher.decode_threads == threads
        outs.append(stage(pa.table(batch)))
        assert used[-1] == threads
    assert outs[0].equals(outs[1])
    t = Teacher(cfg.concepts.teacher)
    assert np.array_equal(t.encode(images, 2, threads=3), t.encode(images, 2))


def _parts(n_rows: int, per_part: int, d: int = 4) -> list[pa.Table]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n_rows, d)).astype(np.float16)
    out = []
    for lo in range(0, n_rows, per_part):
        hi = min(lo + per_part, n_rows)
        out.append(pa.table({
            F.SAMPLE_ID.name: [f"id{i}" for i in range(lo, hi)],
            F.ROW.name: pa.array(np.arange(hi - lo), pa.int64()),
            S.TEACHER_FEATURES_NAME: pa.FixedSizeListArray.from_arrays(
                pa.array(x[lo:hi].ravel()), d),
            S.OBJECT_WORDS.name: [[f"w{i}"] for i in range(lo, hi)],
            S.ATTRIBUTE_WORDS.name: [[] for _ in range(lo, hi)]}))
    return out


def _sample(parts, limit, seed=0):
    s = training_sample(lambda p: parts[p], len(parts), limit, seed)
    return [w[0] for w in s["obj"]], s["x"]


@pytest.mark.parametrize("limit", [None, 500, 37])
def test_the_training_sample_is_bounded_and_independent_of_the_parts(limit):
    words, x = _sample(_parts(300, 300), limit)
    assert len(words) == min(300, limit or 300)
    for per_part in (7, 64):
        assert _sample(_parts(300, per_part), limit)[0] == words
    if limit is None or limit >= 300:
        assert words == [f"w{i}" for i in range(300)]              # every row, in row order
        assert np.array_equal(x, np.concatenate([np.asarray(
            t.column(S.TEACHER_FEATURES_NAME).combine_chunks().flatten()).reshape(-1, 4)
            for t in _parts(300, 300)]))
    else:
        assert _sample(_parts(300, 300), limit, seed=1)[0] != words   # the seed picks rows


def test_the_declared_width_is_what_the_teacher_returns_with_a_pre_logits_layer():
    """timm models with a pre-logits layer (mobilenetv3) return head_hidden_size features,
    not num_features: the schema must say the same, or every part fails to commit."""
    spec = {"id": "mobilenetv3_small_100", "random_init": True}
    stage = build_stage(TeacherStage, C.load(None, {"concepts.teacher": spec}))
    out = stage(pa.table({F.SAMPLE_ID.name: ["a"], F.IMAGE.name: [corpus.jpeg(seed=3)]}))
    width = out.column(S.TEACHER_FEATURES_NAME).type.list_size
    assert width == stage.schema.field(S.TEACHER_FEATURES_NAME).type.list_size == 1024
