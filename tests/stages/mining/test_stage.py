"""The hpm and positives stages in a DAG: ingest -> ids -> embed (test vectors) + a filter ->
hpm -> positives -> export, on the in-process executor and once on Ray."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F, tables
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import Stage
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from vlcurate.stages.mining import fff, hpm
from vlcurate.stages.mining.engine import topk
from vlcurate.stages.mining.pass_io import small_data_error
from vlcurate.stages.mining.positives_stage import PositivesStage
from vlcurate.stages.mining.hpm_stage import HpmStage

from tests.pipeline.test_determinism import differing, snapshot

from .. import corpus
from .naive import pairs

N, D, K = 48, 8, 3
FLAGGED = "test.flagged"
IMG, TXT = pairs(N, D, seed=21, spread=0.9, n_clusters=5)
IMG[1], TXT[1] = IMG[0], TXT[0]                      # row 1 duplicates row 0
CAPTIONS = [f"caption number {i}" for i in range(N)]
VECTORS = {c: (IMG[i], TXT[i]) for i, c in enumerate(CAPTIONS)}
FLAG = {i for i in range(N) if i % 7 == 3}           # flagged upstream of hpm


def fixed(x: np.ndarray) -> pa.Array:
    return pa.FixedSizeListArray.from_arrays(pa.array(x.ravel(), pa.float32()), x.shape[1])


class FakeEmbed(Stage):
    """The embed stage's contract with given vectors (``vectors``: {caption: (image, text)})."""
    name = "embed"
    inputs = {"ingest": (F.CAPTION,)}
    vectors = VECTORS
    output = base = tables.stage_table(E.image_emb(D), E.text_emb(D))

    def __call__(self, batch: pa.Table) -> pa.Table:
        caps = batch.column(F.CAPTION.name).to_pylist()
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         E.IMAGE_EMB_NAME: fixed(np.stack([self.vectors[c][0] for c in caps])),
                         E.TEXT_EMB_NAME: fixed(np.stack([self.vectors[c][1] for c in caps])),
                         F.REASONS.name: pa.array([[]] * len(caps), F.REASONS.type),
                         F.REASON_DETAIL.name: pa.nulls(len(caps), pa.string())},
                        schema=self.base)


class Flag(Stage):
    """A filter beside embed: its flagged rows must never reach hpm."""
    name = "flag"
    inputs = {"ingest": (F.CAPTION,)}
    output = tables.stage_table()

    def __call__(self, batch: pa.Table) -> pa.Table:
        flag = [int(c.split()[-1]) in FLAG for c in batch.column(F.CAPTION.name).to_pylist()]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         F.REASONS.name: pa.array([[FLAGGED] if f else [] for f in flag],
                                                  F.REASONS.type),
                         F.REASON_DETAIL.name: pa.nulls(len(flag), pa.string())},
                        schema=self.output)


class SpyHpm(HpmStage):
    seen: list = []

    def __call__(self, batch: pa.Table) -> pa.Table:
        SpyHpm.seen.extend(batch.column(F.SAMPLE_ID.name).to_pylist())
        return super().__call__(batch)


def dag(hpm_stage=HpmStage):
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(FakeEmbed, after=("ingest", "ids")), Node(Flag, after=("ingest", "ids")),
            Node(hpm_stage, after=("embed", "flag")), Node(PositivesStage, after=("hpm",)),
            Node(ExportStage, after=("ingest", "ids", "embed", "flag", "hpm", "positives"))]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mining_src")
    return corpus.folder(root, [(f"im{i:03d}.jpg", c) for i, c in enumerate(CAPTIONS)])


def cfg(source: Path, run_dir: Path, **over) -> C.Config:
    return C.load(None, {"source.path": str(source), "source.rows_per_part": 10,
                         "run.run_dir": str(run_dir), "run.progress": False,
                         "hpm.k": K, "hpm.tau_image": 0.3, "hpm.tau_text": 0.3,
                         "positives.p2": 0.9, "positives.p3": 0.95,
                         "positives.candidates": {"image": 0.6, "text": 0.6}, **over})


def table(run_dir: Path, stage: str) -> pa.Table:
    return ds.dataset(run_dir / stage / "data", format="parquet").to_table()


def quiet(_):
    pass


def expected(ids: list[str]):
    """Exact HPM over the rows still kept when hpm runs (all but FLAG), in ingest order."""
    kept = [i for i in range(N) if i not in FLAG]
    r = hpm.exact_hpm(IMG[kept], TXT[kept], K, 0.3, 0.3, 0.98)
    r.idx, perm = topk.canonical(r.idx, r.score)        # equal scores: lower row first
    r.score = np.take_along_axis(r.score, perm, 1)
    return kept, r, {ids[kept[q]]: q for q in range(len(kept))}


def test_stage_tables_reasons_and_flagged_rows(source, tmp_path):
    SpyHpm.seen.clear()
    res = {r.manifest["stage"]: r.manifest for r in
           run(cfg(source, tmp_path), dag(SpyHpm), executor="local", log=quiet)}
    ids = table(tmp_path, "ingest").column(F.SAMPLE_ID.name).to_pylist()
    t = table(tmp_path, "hpm")
    assert t.schema.remove_metadata() == M.HARD_PAIRS.remove_metadata()
    assert t.column(F.SAMPLE_ID.name).to_pylist() == ids
    kept, r, q_of = expected(ids)
    flagged_ids = {ids[i] for i in FLAG}
    # flagged rows never reached the stage; they get nulls and are nobody's hard pair
    assert sorted(SpyHpm.seen) == sorted(ids[i] for i in kept)
    assert res["hpm"]["rows_in"] == len(kept)
    rows = t.to_pylist()
    for i, row in enumerate(rows):
        if i in FLAG:
            assert row[M.HARD_IDS.name] is None and row[M.IS_NOISE.name] is None
            assert row[F.REASONS.name] == []
            continue
        q = q_of[ids[i]]
        noise = bool(r.noise[q])
        assert row[M.IS_NOISE.name] == noise and row[M.SUPPORT.name] == r.support[q]
        assert row[M.CERTIFIED.name] is True
        want = [] if noise else [ids[kept[j]] for j in r.idx[q] if j >= 0]
        assert row[M.HARD_IDS.name] == want
        np.testing.assert_allclose(row[M.HARD_SCORES.name], [] if noise else r.score[q][:len(want)],
                                   rtol=1e-5)
        assert row[F.REASONS.name] == ([R.HPM_NOISE] if noise else [])
        assert not flagged_ids & set(row[M.HARD_IDS.name])
        # the pass's candidate pairs: every kept row above the floors, exact similarities
        sii, stt = IMG[kept] @ IMG[i], TXT[kept] @ TXT[i]
        above = [q2 for q2 in range(len(kept)) if q2 != q and (sii[q2] > 0.6 or stt[q2] > 0.6)]
        assert row[M.PAIR_IDS.name] == [ids[kept[q2]] for q2 in above]
        np.testing.assert_allclose(row[M.PAIR_SII.name], sii[above], atol=1e-5)
        np.testing.assert_allclose(row[M.PAIR_STT.name], stt[above], atol=1e-5)
        assert row[M.PAIR_SIT.name] is None                 # no cross-modal embedding
    assert sum(len(row[M.PAIR_IDS.name] or []) for row in rows) > 20
    n_noise = int(r.noise.sum())
    assert 0 < n_noise < len(kept)
    assert res["hpm"]["reason_counts"] == {R.HPM_NOISE: n_noise}
    assert ids[1] not in rows[0][M.HARD_IDS.name]            # a duplicate is not a hard pair
    # positives: computed after noise removal, on the survivors only, = FFF on them
    survivors = [i for i in kept if not r.noise[q_of[ids[i]]]]
    assert res["positives"]["rows_in"] == len(survivors)
    p = table(tmp_path, "positives")
    assert p.schema.remove_metadata() == M.POSITIVES.remove_metadata()
    ref = fff.exact_positives(IMG[survivors], TXT[survivors], fff.Rule(p2=0.9, p3=0.95), 64)
    prow = {x[F.SAMPLE_ID.name]: x for x in p.to_pylist()}
    for q, i in enumerate(survivors):
        row = prow[ids[i]]
        assert row[M.POSITIVE_IDS.name] == [ids[survivors[j]] for j in ref.idx[q] if j >= 0]
        assert row[M.POSITIVE_RELATIONS.name] == [fff.CODES[c] for c in ref.code[q] if c >= 0]
    assert prow[ids[0]][M.POSITIVE_IDS.name][0] == ids[1]             # the duplicate
    assert prow[ids[0]][M.POSITIVE_RELATIONS.name][0] == M.REL_DUPLICATE
    assert sum(len(x[M.POSITIVE_IDS.name] or []) for x in prow.values()) >= 10
    # export drops noise pairs and flagged rows under the default policy, and keeps the columns
    exp = table(tmp_path, "export")
    assert sum(exp.column(F.KEEP.name).to_pylist()) == len(survivors)
    assert {M.HARD_IDS.name, M.POSITIVE_IDS.name} <= set(exp.column_names)


def test_mark_keeps_noise_pairs_and_fast_method_matches(source, tmp_path):
    over = {"hpm.noise_action": "mark", "hpm.method": "fast",
            "hpm.fast": {"nlist": 2, "nprobe": 2, "k_prime": 64, "pq_m": 4}}
    res = {r.manifest["stage"]: r.manifest for r in
           run(cfg(source, tmp_path, **over), dag(), executor="local", log=quiet)}
    ids = table(tmp_path, "ingest").column(F.SAMPLE_ID.name).to_pylist()
    kept, r, q_of = expected(ids)
    rows = table(tmp_path, "hpm").to_pylist()
    assert res["hpm"]["rows_rejected"] == 0
    for i in kept:
        row, q = rows[i], q_of[ids[i]]
        assert row[F.REASONS.name] == [] and row[M.IS_NOISE.name] == bool(r.noise[q])
        want = [] if r.noise[q] else [ids[kept[j]] for j in r.idx[q] if j >= 0]
        assert row[M.HARD_IDS.name] == want and row[M.CERTIFIED.name]
    assert res["positives"]["rows_in"] == len(kept)       # noise pairs stay in
    assert all(row[M.PAIR_IDS.name] is None for row in rows)   # FastHPM finds no pairs
    assert sum(table(tmp_path, "export").column(F.KEEP.name).to_pylist()) == len(kept)


def test_ray_executor_gives_the_same_tables(source, tmp_path, ray_local):
    """hpm and positives on Ray (actors load the state and the vectors from the run dir) over
    the upstream tables of an in-process run (skipped there: same fingerprints)."""
    small = [Node(IngestStage), Node(FakeEmbed, after=("ingest",)),
             Node(HpmStage, after=("embed",)), Node(PositivesStage, after=("hpm",))]
    local, remote = tmp_path / "local", tmp_path / "ray"
    over = {"source.rows_per_part": N // 2, "ray.address": "local", "hpm.method": "blocks",
            "hpm.engine.clusters": 4, "hpm.engine.probe": 2}
    run(cfg(source, local, **over), small, executor="local", log=quiet)
    shutil.copytree(local, remote, ignore=shutil.ignore_patterns("hpm", "positives"))
    # every part mined on an actor pool of 2 (resources: the same fingerprint, the same bytes)
    res = run(cfg(source, remote, **over, **{"hpm.resources": {"num_cpus": 0.5,
                                                                "concurrency": 2}}),
              small, executor="ray", log=quiet)
    assert [r.status for r in res] == ["skipped", "skipped", "ran", "ran"]
    for stage in ("hpm", "positives"):
        assert table(remote, stage).equals(table(local, stage))
    assert table(remote, "hpm").column(M.IS_NOISE.name).to_pylist().count(True) > 0


class CrossEmbed(FakeEmbed):
    """The embed contract plus cross-modal (CLIP-like) columns, for FFF's full Eq. 1."""
    output = tables.stage_table(E.image_emb(D), E.text_emb(D), E.cross_image_emb(4),
                                E.cross_text_emb(4))

    def __call__(self, batch: pa.Table) -> pa.Table:
        t = super().__call__(batch)
        i = [int(c.split()[-1]) for c in batch.column(F.CAPTION.name).to_pylist()]
        return t.append_column(E.CROSS_IMAGE_EMB_NAME, fixed(XIMG[i])).append_column(
            E.CROSS_TEXT_EMB_NAME, fixed(XTXT[i])).select(self.output.names)


XIMG = hpm.normalize(IMG[:, :4] + 0.2 * np.random.default_rng(5).standard_normal((N, 4)))
XTXT = hpm.normalize(IMG[:, :4] + 0.2 * np.random.default_rng(6).standard_normal((N, 4)))


def test_positives_with_a_cross_modal_embedding(source, tmp_path):
    d = [Node(IngestStage), Node(CrossEmbed, after=("ingest",)),
         Node(PositivesStage, after=("embed",))]
    # a cross-modal model configured: the positives run the full rule (CrossEmbed stands in for it)
    over = {"embed.cross_model": {"id": "tiny-clip", "random_init": True}, "positives.p1": 0.9,
            "positives.p1_text": 0.8}
    run(cfg(source, tmp_path, **over), d, executor="local", log=quiet)
    ids = table(tmp_path, "ingest").column(F.SAMPLE_ID.name).to_pylist()
    rule = fff.Rule(p1=0.9, p1_text=0.8, p2=0.9, p3=0.95, cross=True)
    ref = fff.exact_positives(IMG, TXT, rule, 64, ximg=XIMG, xtxt=XTXT)
    rows = table(tmp_path, "positives").to_pylist()
    for i, row in enumerate(rows):
        assert row[M.POSITIVE_IDS.name] == [ids[j] for j in ref.idx[i] if j >= 0]
        assert row[M.POSITIVE_RELATIONS.name] == [fff.CODES[c] for c in ref.code[i] if c >= 0]
    assert any(M.REL_CROSS in r[M.POSITIVE_RELATIONS.name] for r in rows)


def test_store_skips_rows_without_embeddings_and_reads_float16(tmp_path):
    from vlcurate.stages.mining.store import Store, collect
    x = np.array([[3, 4], [1, 0], [0, 2]], np.float32)

    def read(part):
        emb = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel(), pa.float16()), 2)
        emb = pa.array([emb[0].as_py(), None, emb[2].as_py()], emb.type) if part == 1 else emb
        return pa.table({F.SAMPLE_ID.name: [f"p{part}r{r}" for r in range(3)],
                         E.IMAGE_EMB_NAME: emb, E.TEXT_EMB_NAME: emb,
                         F.ROW.name: pa.array([0, 1, 2], pa.int64())})

    meta = collect(read, 2, str(tmp_path), (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME))
    assert meta.n == 5 and meta.starts == (0, 3) and meta.counts == (3, 2)
    s = Store(meta)
    np.testing.assert_allclose(s.vec[E.IMAGE_EMB_NAME][0], [0.6, 0.8], rtol=1e-3)   # normalised
    np.testing.assert_array_equal(s.locate(np.array([1, 1, 1, 0]), np.array([0, 1, 2, 2])),
                                  [3, -1, 4, 2])
    assert s.id_lists(np.array([[4, -1], [-1, -1]])).to_pylist() == [["p1r2"], []]
    # ids -> rows (positives' candidates): -1 for ids not stored (p1r1 had no embedding), and
    # a row's list read back in its order; and with no rows stored at all
    want = ["p1r2", "p0r0", "nope", "p1r1", "", "p0r2", "p1r0"]
    np.testing.assert_array_equal(s.lookup(pa.array(want)), [4, 0, -1, -1, -1, 2, 3])
    empty = Store(collect(lambda p: read(p).slice(0, 0), 1, str(tmp_path / "e"),
                          (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME)))
    assert empty.lookup(pa.array(["p0r0"])).tolist() == [-1]
    assert s.lookup(pa.array([], pa.string())).tolist() == []


@pytest.mark.parametrize("k", [100, 40])
def test_small_data_stops_before_hpm_naming_hpm_k(source, tmp_path, k):
    """41 kept rows cannot support k = 100 (fewer rows than k) nor k = 40 (no row has
    40 supporters): the run stops in hpm's global step with an actionable error."""
    kept = [i for i in range(N) if i not in FLAG]
    best = 40 if k == 100 else int(hpm.exact_hpm(IMG[kept], TXT[kept], k, 0.3, 0.3).support.max())
    with pytest.raises(ValueError) as e:
        run(cfg(source, tmp_path, **{"hpm.k": k}), dag(), executor="local", log=quiet)
    assert str(e.value) == small_data_error(k, len(kept), best)
    assert str(e.value).startswith(f"hpm.k = {k} cannot be supported by the 41 rows kept")
    assert f"Set hpm.k to at most {best}" in str(e.value)
    assert not (tmp_path / "hpm" / "data").exists()          # no part of hpm was written


def test_pairs_cut_by_max_pairs_reach_the_run_summary(source, tmp_path):
    """positives.candidates.max_pairs: the count of candidate pairs it cut is the stage's info and
    a NOTE of the run summary (no silent cap), and each row's pair list is capped."""
    from vlcurate.pipeline.summary import format_summary
    results = run(cfg(source, tmp_path, **{"positives.candidates.max_pairs": 2}), dag(),
                  executor="local", log=quiet)
    info = {r.manifest["stage"]: r.info for r in results}["hpm"]
    kept = [i for i in range(N) if i not in FLAG]
    sii, stt = IMG[kept] @ IMG[kept].T, TXT[kept] @ TXT[kept].T
    above = ((sii > 0.6) | (stt > 0.6)) & ~np.eye(len(kept), dtype=bool)
    want = int(np.maximum(above.sum(1) - 2, 0).sum())
    assert info["pairs_cut"] == want > 0 and info["max_pairs"] == 2
    assert any("positives.candidates.max_pairs = 2" in n and str(want) in n for n in info["notes"])
    assert all(len(x or []) <= 2 for x in table(tmp_path, "hpm").column(M.PAIR_IDS.name).to_pylist())
    assert f"{want} candidate pairs" in format_summary(results)
    # an up-to-date rerun reads the same info back from _info.json
    again = {r.manifest["stage"]: r
             for r in run(cfg(source, tmp_path, **{"positives.candidates.max_pairs": 2}),
                          dag(), executor="local", log=quiet)}["hpm"]
    assert again.status == "skipped" and again.info["pairs_cut"] == want


def test_positives_read_hpms_pairs_and_a_threshold_change_reruns_positives_only(source, tmp_path,
                                                                               monkeypatch):
    """The seam hpm -> positives: positives' candidates are hpm's persisted pairs (its
    own search never runs), so positives.candidates.max_pairs changes the positives; a positives
    threshold change reruns positives alone, reading the same pairs, with the result exact Eq. 1 again."""
    def runs(**over):
        with monkeypatch.context() as m:
            m.setattr(fff, "search", no_search)
            m.setattr(fff.FastPositives, "query", no_search)
            return run(cfg(source, tmp_path, **over), dag()[:-1], executor="local", log=quiet)

    def no_search(*a, **k):
        raise AssertionError("positives searched on its own")
    res = runs()
    ids = table(tmp_path, "ingest").column(F.SAMPLE_ID.name).to_pylist()
    kept, r, q_of = expected(ids)
    survivors = [i for i in kept if not r.noise[q_of[ids[i]]]]

    def check(p2):
        ref = fff.exact_positives(IMG[survivors], TXT[survivors], fff.Rule(p2=p2, p3=0.95), 64)
        got = {x[F.SAMPLE_ID.name]: x[M.POSITIVE_IDS.name]
               for x in table(tmp_path, "positives").to_pylist()}
        for q, i in enumerate(survivors):
            assert got[ids[i]] == [ids[survivors[j]] for j in ref.idx[q] if j >= 0]
        return sum(len(v or []) for v in got.values())
    before = check(0.9)
    again = runs(**{"positives.p2": 0.7})
    status = {x.manifest["stage"]: x.status for x in again}
    assert status["hpm"] == "skipped" and status["positives"] == "ran"
    assert check(0.7) > before > 0
    # fewer candidate pairs from hpm: fewer positives (the values cross the seam)
    runs(**{"positives.candidates.max_pairs": 1})
    counts = table(tmp_path, "positives").column(M.POSITIVE_COUNT.name).to_pylist()
    assert 0 < sum(c or 0 for c in counts) < before
    assert max(c or 0 for c in counts) <= 1
    assert [x.status for x in res].count("ran") == len(res)
    info = {x.manifest["stage"]: x.info for x in res}
    assert info["positives"]["candidates"].startswith("hpm's neighbour pass")


def test_a_partial_pass_serves_positives_through_its_one_space_layouts(source, tmp_path,
                                                                      monkeypatch):
    """A partial pass (probe < clusters) routes on the joint vector and misses pairs near in one
    space only. With hpm.engine.pair_probe 0 positives keeps its own (here exact) search; with its
    one-space layouts (stages/mining/engine/spaces.py) the pass finds more pairs, positives reads them
    and searches nothing. Either way the result is exact Eq. 1."""
    calls = []
    search = fff.search
    monkeypatch.setattr(fff, "search", lambda *a, **k: calls.append(1) or search(*a, **k))

    def runs(pair_probe):
        over = {"hpm.method": "blocks", "hpm.engine.clusters": 4, "hpm.engine.probe": 1,
                "hpm.engine.pair_probe": pair_probe}
        calls.clear()
        res = run(cfg(source, tmp_path, **over), dag()[:-1], executor="local", log=quiet)
        said = {x.manifest["stage"]: x.info for x in res}["positives"]["candidates"]
        said = ("searched " if calls else "") + said
        ids = table(tmp_path, "ingest").column(F.SAMPLE_ID.name).to_pylist()
        hp = {x[F.SAMPLE_ID.name]: x for x in table(tmp_path, "hpm").to_pylist()}
        survivors = [i for i in range(N) if i not in FLAG and not hp[ids[i]][M.IS_NOISE.name]]
        ref = fff.exact_positives(IMG[survivors], TXT[survivors], fff.Rule(p2=0.9, p3=0.95), 64)
        got = {x[F.SAMPLE_ID.name]: x[M.POSITIVE_IDS.name]
               for x in table(tmp_path, "positives").to_pylist()}
        for q, i in enumerate(survivors):
            assert got[ids[i]] == [ids[survivors[j]] for j in ref.idx[q] if j >= 0]
        return said, sum(len(x[M.PAIR_IDS.name] or []) for x in hp.values())
    said, joint_pairs = runs(0)
    assert said.startswith("searched its own exact search (hpm's pass is partial"), said
    said, pairs = runs(4)
    assert said.startswith("hpm's neighbour pass (partial: 1 of 4"), said
    assert pairs > joint_pairs


@pytest.mark.parametrize("precision", ["bf16", "int8", "auto"])
def test_hpm_precision_reaches_the_pass_and_finds_the_same_pairs(precision, source, tmp_path,
                                                                monkeypatch):
    """Config to stage: hpm.engine.precision bf16 (or int8) screens every block (DENSE_SHARE 1: this
    data is dense) and re-scores; the hard pairs, noise flags and candidate pairs equal fp32's.
    The workers read the low copies the global step wrote (int8: with each cluster's scale and
    bounds, q8.Copy). auto: int8 on a CPU with AVX512-VNNI or AMX, else fp32; the run summary
    says which ran."""
    from vlcurate.stages.mining.engine import screen
    from vlcurate.stages.mining.engine.precision import resolve
    ran = resolve(precision, "cpu").name
    cols = [F.SAMPLE_ID.name, M.HARD_IDS.name, M.IS_NOISE.name, M.PAIR_IDS.name]
    run(cfg(source, tmp_path / "fp32", **{"hpm.engine.precision": "fp32"}), dag()[:-2],
        executor="local", log=quiet)
    want = table(tmp_path / "fp32", "hpm").select(cols).sort_by(F.SAMPLE_ID.name)
    calls, stored = [], []
    rescore, low_rows = screen.rescore, screen.low_rows
    monkeypatch.setattr(screen, "rescore", lambda *a: calls.append(1) or rescore(*a))
    monkeypatch.setattr(screen, "low_rows", lambda *a: stored.append(1) or low_rows(*a))
    monkeypatch.setattr(screen, "DENSE_SHARE", 1.0)
    results = run(cfg(source, tmp_path / precision, **{"hpm.engine.precision": precision}),
                  dag()[:-2], executor="local", log=quiet)
    got = table(tmp_path / precision, "hpm").select(cols).sort_by(F.SAMPLE_ID.name)
    assert got.equals(want)
    assert {r.manifest["stage"]: r.info for r in results}["hpm"]["precision"] == ran
    if ran != "fp32":
        assert calls and stored                      # stored: the low copies written once
        assert list((tmp_path / precision).rglob(f"img.{ran}"))
    assert sum(len(x or []) for x in want.column(M.PAIR_IDS.name).to_pylist()) > 20


def test_hpm_chunk_rows_sets_the_rows_mined_together_and_batches_keep_to_it(source, tmp_path,
                                                                           monkeypatch):
    """hpm.engine.chunk_rows: the stage is called on chunks of that many rows (across parts, not
    run.chunk_rows); its batch is one chunk whatever resources.batch_size, so the tables are
    byte-identical; the pairs equal the default chunks' (a row's result does not depend on
    the rows mined with it)."""
    cols = [F.SAMPLE_ID.name, M.HARD_IDS.name, M.IS_NOISE.name, M.PAIR_IDS.name]
    run(cfg(source, tmp_path / "default"), dag()[:-2], executor="local", log=quiet)
    sizes = []
    mine = HpmStage.mine
    monkeypatch.setattr(HpmStage, "mine", lambda self, g: sizes.append(len(g)) or mine(self, g))
    tables_ = []
    for i, batch in enumerate((0, 3)):
        run(cfg(source, tmp_path / f"c{i}", **{"hpm.engine.chunk_rows": 4,
                                               "hpm.resources": {"batch_size": batch}}),
            dag()[:-2], executor="local", log=quiet)
        tables_.append(table(tmp_path / f"c{i}", "hpm").sort_by(F.SAMPLE_ID.name))
    assert max(sizes) <= 4 and sizes.count(4) > 5
    assert tables_[0].equals(tables_[1])
    want = table(tmp_path / "default", "hpm").select(cols).sort_by(F.SAMPLE_ID.name)
    assert tables_[0].select(cols).equals(want)


def test_hpm_chunks_span_parts_and_a_resumed_run_mines_the_same_chunks(source, tmp_path,
                                                                       monkeypatch):
    """hpm.engine.chunk_rows 15 over 10-row parts: a call mines rows of two parts. A run stopped on
    its second call (part 0 committed, part 1 half written) resumes on the same chunks: the
    first one reads part 0 again, for context, and does not rewrite it; the tables are
    byte-identical to an uninterrupted run's."""
    over = {"hpm.engine.chunk_rows": 15}
    calls: list = []
    real = HpmStage.__call__

    def spy(self, batch):
        calls.append(sorted(set(batch.column(F.PART.name).to_pylist())))
        if len(calls) == fail_on:
            raise RuntimeError("stopped")
        return real(self, batch)

    monkeypatch.setattr(HpmStage, "__call__", spy)
    fail_on = 0
    run(cfg(source, tmp_path / "clean", **over), dag()[:-2], executor="local", log=quiet)
    assert calls[:2] == [[0, 1], [1, 2]]
    calls.clear()
    fail_on = 2
    with pytest.raises(RuntimeError, match="stopped"):
        run(cfg(source, tmp_path / "run", **over), dag()[:-2], executor="local", log=quiet)
    hpm_dir = tmp_path / "run" / "hpm"
    assert StageDir(str(tmp_path / "run"), "hpm").committed() == [0]
    before = {p: p.stat().st_mtime_ns for p in (hpm_dir / "data" / "part-00000").iterdir()}
    calls.clear()
    fail_on = 0
    run(cfg(source, tmp_path / "run", **over), dag()[:-2], executor="local", log=quiet)
    assert calls[0] == [0, 1]                        # part 0 read again, as the chunk's context
    assert {p: p.stat().st_mtime_ns for p in before} == before     # and not written again
    want, got = ({k: v for k, v in snapshot(tmp_path / r).items() if k.startswith("hpm/")}
                 for r in ("clean", "run"))
    assert sum(k.startswith("hpm/data/") for k in want) == 5 and differing(got, want) == []


def test_a_spanning_stage_resumes_on_ray_on_the_same_chunks(source, tmp_path, ray_local):
    """On Ray too: an in-process run's tables with hpm's part 1 lost (its commit record and its
    data). The Ray rerun mines only the chunks holding part 1's rows (parts 0 and 2 read as
    context, never rewritten) and the tables are byte-identical to the uninterrupted run's."""
    over = {"hpm.engine.chunk_rows": 15, "ray.address": "local"}
    run(cfg(source, tmp_path / "clean", **over), dag()[:-2], executor="local", log=quiet)
    shutil.copytree(tmp_path / "clean", tmp_path / "run")
    hpm_dir = tmp_path / "run" / "hpm"
    (hpm_dir / "_commit" / "part-00001.json").unlink()
    for f in (hpm_dir / "data" / "part-00001").iterdir():
        f.unlink()
    context = {f: f.stat().st_mtime_ns for d in ("part-00000", "part-00002")
               for f in (hpm_dir / "data" / d).iterdir()}
    res = run(cfg(source, tmp_path / "run", **over), dag()[:-2], executor="ray", log=quiet)
    assert {r.manifest["stage"]: r.status for r in res}["hpm"] == "repaired"
    assert {f: f.stat().st_mtime_ns for f in context} == context
    want, got = ({k: v for k, v in snapshot(tmp_path / r).items() if k.startswith("hpm/")}
                 for r in ("clean", "run"))
    assert sum(k.startswith("hpm/data/part-00001") for k in got) >= 1
    assert differing(got, want) == []


def test_hpm_on_the_gpu_finds_the_pairs_of_the_cpu(source, tmp_path, cuda):
    """hpm.device cuda through the stage (the global step's layout, the sorted vectors resident
    on the GPU, the per-part mining): the hard pairs, noise flags and candidate pairs of the
    same run on the CPU (similarities may differ in their last bits: not compared)."""
    cols = [F.SAMPLE_ID.name, M.HARD_IDS.name, M.IS_NOISE.name, M.PAIR_IDS.name]
    for dev in ("cpu", cuda):
        run(cfg(source, tmp_path / dev, **{"hpm.device": dev}), dag()[:-2], executor="local",
            log=quiet)
    want, got = (table(tmp_path / d, "hpm").select(cols).sort_by(F.SAMPLE_ID.name)
                 for d in ("cpu", cuda))
    assert got.equals(want)
    assert sum(len(x or []) for x in want.column(M.HARD_IDS.name).to_pylist()) > 20


# a partial pass with one-space layouts: hpm's sorted order is far from the row order
SORTED = {"hpm.method": "blocks", "hpm.engine.clusters": 4, "hpm.engine.probe": 1,
          "hpm.engine.pair_probe": 4}


def test_positives_read_hpms_sorted_vectors_and_equal_their_own_collect(source, tmp_path):
    """Vectors stored once: positives collects ids only and reads hpm's sorted vectors
    at its rows' sorted positions (hpm's noise pairs dropped in between). With hpm's global
    step gone (a run directory from before, files deleted) it collects its own: the same bytes."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        run(cfg(source, d, **SORTED), dag()[:-1], executor="local", log=quiet)
    prep = a / "positives" / "_prepare"
    at = np.load(prep / "sorted_rows.npy")
    assert not list(prep.glob("*.f32")) and len(at) < N - len(FLAG)        # noise left out
    assert (at != np.arange(len(at))).any() and len(np.unique(at)) == len(at)
    (b / "hpm" / "_state.pkl").unlink()
    shutil.rmtree(b / "positives")
    res = run(cfg(source, b, **SORTED), dag()[:-1], executor="local", log=quiet)
    assert [r.status for r in res][-2:] == ["skipped", "ran"]
    assert list((b / "positives" / "_prepare").glob("*.f32"))              # its own collect
    said = {r.manifest["stage"]: r.info for r in res}["positives"]["candidates"]
    assert said.endswith("vectors: its own collect"), said
    assert table(a, "positives").equals(table(b, "positives"))
    assert sum(len(x or []) for x in table(a, "positives")
               .column(M.POSITIVE_IDS.name).to_pylist()) > 0
    # a run directory copied elsewhere: hpm's state names the old place, which is gone; positives
    # finds hpm's files where they are now (the runner's workdir, not the state's paths)
    c = tmp_path / "c"
    shutil.copytree(a, c, ignore=shutil.ignore_patterns("positives"))
    shutil.rmtree(a / "hpm" / "_prepare")
    res = run(cfg(source, c, **SORTED), dag()[:-1], executor="local", log=quiet)
    assert [r.status for r in res][-2:] == ["skipped", "ran"]
    prep = c / "positives" / "_prepare"
    assert (prep / "sorted_rows.npy").exists() and not list(prep.glob("*.f32"))
    assert {r.manifest["stage"]: r.info for r in res}["positives"]["candidates"].endswith(
        "vectors: hpm's sorted copy")
    assert table(c, "positives").equals(table(b, "positives"))


def test_positives_read_a_bf16_pass_and_find_fp32s_positives(source, tmp_path):
    """Seam hpm -> positives under hpm.engine.precision bf16: hpm lays out and routes with bf16
    GEMMs and stores bf16 copies; positives reads hpm's fp32 sorted vectors at its rows' positions in
    that layout and finds the same positives as in an fp32 run (this data's spaces are searched
    whole)."""
    cols = [F.SAMPLE_ID.name, M.POSITIVE_IDS.name, M.POSITIVE_COUNT.name]
    got = {}
    for precision in ("fp32", "bf16"):
        d = tmp_path / precision
        res = run(cfg(source, d, **SORTED, **{"hpm.engine.precision": precision}), dag()[:-1],
                  executor="local", log=quiet)
        said = {r.manifest["stage"]: r.info for r in res}["positives"]["candidates"]
        assert said.endswith("vectors: hpm's sorted copy"), said
        got[precision] = table(d, "positives").select(cols).sort_by(F.SAMPLE_ID.name)
    assert list((tmp_path / "bf16" / "hpm").rglob("*.bf16"))        # bf16 copies stored
    assert got["bf16"].equals(got["fp32"])
    assert sum(len(x or []) for x in got["fp32"].column(M.POSITIVE_IDS.name).to_pylist()) > 0


def test_positives_on_another_node_fetch_hpms_vectors_from_the_bucket(source, tmp_path, s3):
    """A run directory on S3: positives' global step and actors on a node without hpm's files
    (its node-local scratch emptied) fetch them from the bucket, and give the local run's table."""
    import tempfile
    local, remote = tmp_path / "local", f"{s3.bucket()}/run"
    run(cfg(source, local, **SORTED), dag()[:-1], executor="local", log=quiet)
    run(cfg(source, remote, **SORTED), dag()[:-1], executor="local", log=quiet)
    scratch = Path(tempfile.gettempdir()) / "vlcurate-scratch"
    shutil.rmtree(scratch)
    StageDir(remote, "positives").reset()
    res = run(cfg(source, remote, **SORTED), dag()[:-1], executor="local", log=quiet)
    assert [r.status for r in res][-2:] == ["skipped", "ran"]
    assert list(scratch.glob("*/*/_prepare/pass/img.f32"))                 # hpm's, fetched
    got = pa.concat_tables(StageDir(remote, "positives").read(p) for p in range(res[-1]
                                                                              .manifest["parts"]))
    assert got.equals(table(local, "positives"))


CAL_N = 640
CAL_IMG, CAL_TXT = pairs(CAL_N, D, seed=4, spread=0.5, n_clusters=12)


class CalEmbed(FakeEmbed):
    vectors = {f"calibrate {i}": (CAL_IMG[i], CAL_TXT[i]) for i in range(CAL_N)}


@pytest.fixture(scope="module")
def cal_source(tmp_path_factory) -> Path:
    return corpus.folder(tmp_path_factory.mktemp("cal_src"),
                         [(f"c{i:03d}.jpg", c) for i, c in enumerate(CalEmbed.vectors)])


def test_the_stage_calibrates_its_probe_to_hpm_engine_recall(cal_source, tmp_path):
    """engine.probe null on a partial pass (80 clusters, more than pass_io.AUTO's 60): hpm's global
    step calibrates the probe (calibrate.py) to hpm.engine.recall; the run summary says which
    probe, a higher recall asks for more clusters, and the hard pairs reach the recall."""
    small = [Node(IngestStage), Node(CalEmbed, after=("ingest",)), Node(HpmStage, after=("embed",))]
    exact = hpm.exact_hpm(CAL_IMG, CAL_TXT, K, 0.3, 0.3, 0.98)
    got = {}
    for recall in (0.8, 0.99):
        over = {"source.rows_per_part": 320, "hpm.method": "blocks", "hpm.engine.clusters": 80,
                "hpm.engine.recall": recall}
        res = run(cfg(cal_source, tmp_path / str(recall), **over), small, executor="local",
                  log=quiet)
        info = {r.manifest["stage"]: r.info for r in res}["hpm"]
        assert info["clusters"] == 80 and 1 <= info["probe"] < 60, info
        rows = table(tmp_path / str(recall), "hpm").to_pylist()
        ingest = table(tmp_path / str(recall), "ingest").to_pydict()
        row_of = {s: int(c.split()[-1])        # sample id -> row of CAL_IMG ("calibrate i")
                  for s, c in zip(ingest[F.SAMPLE_ID.name], ingest[F.CAPTION.name])}
        found = want = 0
        for r in rows:
            i = row_of[r[F.SAMPLE_ID.name]]
            truth = {j for j in exact.idx[i] if j >= 0} if not exact.noise[i] else set()
            found += len(truth & {row_of[s] for s in r[M.HARD_IDS.name] or []})
            want += len(truth)
        got[recall] = (info["probe"], found / want)
    assert got[0.8][0] < got[0.99][0], got
    assert got[0.8][1] >= 0.8 - 0.05 and got[0.99][1] >= 0.99 - 0.02, got
