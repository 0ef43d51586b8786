"""The sibling rule through the real seams: ingest -> ids (image groups) -> embed (given
vectors) -> hpm -> export, on multi-caption data (several rows per image file) and on one
caption per image, where the rule changes no byte."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F, tables
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import reasons as R
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from vlcurate.stages.mining import hpm
from vlcurate.stages.mining.engine import siblings
from vlcurate.stages.mining.hpm_stage import HpmStage

from .. import corpus
from .test_siblings import multi_caption, unit
from .test_stage import FakeEmbed, quiet, table

K, TAU = 2, 0.5
IMG, TXT, GROUP, LABELS = multi_caption(groups=6, per=4, d=16, seed=4, swap=(1, 9))
# images 4 and 5 alike, with captions of one topic: their rows support each other in Alg. 1
IMG[GROUP == 5] = unit(IMG[GROUP == 4][0] + 0.5 * IMG[GROUP == 5][0])
TXT[GROUP == 5] = unit(TXT[GROUP == 4] + 0.1 * np.roll(TXT[GROUP == 5], 1, axis=1))
CAPTIONS = [f"caption {i} of image {g}" for i, g in enumerate(GROUP)]
ONE = [f"only caption of image {i}" for i in range(24)]      # one caption per image
VECTORS = {**{c: (IMG[i], TXT[i]) for i, c in enumerate(CAPTIONS)},
           **{c: (IMG[i], TXT[i]) for i, c in enumerate(ONE)}}


class GivenEmbed(FakeEmbed):
    vectors = VECTORS
    output = base = tables.stage_table(E.image_emb(16), E.text_emb(16))


DAG = [Node(IngestStage), Node(IdsStage, after=("ingest",)), Node(GivenEmbed, after=("ids",)),
       Node(HpmStage, after=("embed",)), Node(ExportStage, after=("ingest", "ids", "hpm"))]


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> Path:
    """Four captions per image file (rows of one image share its bytes: one image_group)."""
    return corpus.folder(tmp_path_factory.mktemp("multi"),
                         [(f"im{g}.jpg", c) for g, c in zip(GROUP, CAPTIONS)])


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return corpus.folder(tmp_path_factory.mktemp("single"),
                         [(f"im{i:02d}.jpg", c) for i, c in enumerate(ONE)])


def mined(source: Path, run_dir: Path, **over) -> pa.Table:
    cfg = C.load(None, {"source.path": str(source), "source.rows_per_part": 10,
                        "run.run_dir": str(run_dir), "run.progress": False, "hpm.k": K,
                        "hpm.tau_image": TAU, "hpm.tau_text": TAU,
                        "hpm.siblings": {"tau_text": TAU}, **over})
    run(cfg, DAG, executor="local", log=quiet)
    return table(run_dir, "hpm")


def test_agreeing_siblings_rescue_rows_and_export_drops_only_the_mismatch(multi, tmp_path):
    t = mined(multi, tmp_path / "on")
    assert t.schema.remove_metadata() == M.HARD_PAIRS.remove_metadata()
    want = siblings.agreeing(GROUP, IMG, TXT, TAU, TAU, 0.98, TAU)
    support = hpm.exact_hpm(IMG, TXT, K, TAU, TAU, 0.98).support
    assert t.column(M.SIBLINGS.name).to_pylist() == want.tolist()
    assert t.column(M.SUPPORT.name).to_pylist() == support.tolist()
    assert t.column(M.IS_NOISE.name).to_pylist() == LABELS.tolist()
    reasons = t.column(F.REASONS.name).to_pylist()
    assert reasons == [[R.HPM_NOISE] if x else [] for x in LABELS]
    keep = table(tmp_path / "on", "export").column(F.KEEP.name).to_pylist()
    assert keep == (~LABELS).tolist()                    # the default policy drops it alone
    # HELIP's rule alone flags every row whose only evidence is its siblings
    off = mined(multi, tmp_path / "off", **{"hpm.siblings": {"support": False}})
    assert off.column(M.SIBLINGS.name).to_pylist() == [0] * len(GROUP)
    assert off.column(M.IS_NOISE.name).to_pylist() == (support < K).tolist()
    assert sum(table(tmp_path / "off", "export").column(F.KEEP.name).to_pylist()) == \
        int((support >= K).sum()) < sum(keep)


def test_one_caption_per_image_changes_no_byte(single, tmp_path):
    on = mined(single, tmp_path / "on")
    off = mined(single, tmp_path / "off", **{"hpm.siblings": {"support": False}})
    assert on.column(M.SIBLINGS.name).to_pylist() == [0] * len(ONE)
    assert on.equals(off)
    want = hpm.exact_hpm(IMG, TXT, K, TAU, TAU, 0.98)
    assert on.column(M.IS_NOISE.name).to_pylist() == want.noise.tolist()


def test_parts_batches_chunks_and_fast_give_the_same_decisions(multi, tmp_path):
    ref = mined(multi, tmp_path / "ref")
    other = mined(multi, tmp_path / "other", **{"source.rows_per_part": 7,
                                                "hpm.resources": {"batch_size": 3},
                                                "hpm.engine": {"chunk_rows": 5}})
    assert other.equals(ref)
    fast = mined(multi, tmp_path / "fast", **{"hpm.method": "fast", "hpm.fast": {
        "nlist": 2, "nprobe": 2, "k_prime": 23, "pq_m": 4}})
    for c in (M.SIBLINGS, M.SUPPORT, M.IS_NOISE, M.HARD_IDS):
        assert fast.column(c.name).equals(ref.column(c.name)), c.name
