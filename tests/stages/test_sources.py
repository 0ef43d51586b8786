"""Several sources in one run, and the quick-trial narrowing (source.sample, source.limit,
``vlcurate run --limit``): the plan and the reads, through the runner and the CLI."""
from __future__ import annotations

import random

import pyarrow.dataset as ds
import pytest
import yaml

from . import corpus
from tests.pipeline.test_runner import by_stage, quiet, spine
from vlcurate.pipeline import config as C
from vlcurate.pipeline.runner import run, stage_config
from vlcurate.schemas import F
from vlcurate.stages.ingest import IngestStage, sample_id, sources


def _rows(n: int, prefix: str = "") -> list[tuple[str, str]]:
    return [(f"{prefix}{i}.jpg", f"a photo number {i}") for i in range(n)]


def _keys(cfg, tmp_path) -> list[tuple[str, str]]:
    specs = sources.plan(cfg.source, str(tmp_path / "_plan.parquet"))
    assert [s["part"] for s in specs] == list(range(len(specs)))
    out = []
    for spec in specs:
        t = sources.read_part(cfg.source, spec)
        out += zip(t.column(F.SOURCE.name).to_pylist(), t.column(F.KEY.name).to_pylist())
    return out


def test_two_sources_read_one_after_the_other_with_their_own_names(tmp_path):
    a = corpus.folder(tmp_path / "a", _rows(5))
    b = corpus.write_tar(tmp_path / "b" / "000.tar",
                         [(f"{i:03d}.{ext}", corpus.jpeg(seed=i) if ext == "jpg" else b"tar text")
                          for i in range(3) for ext in ("jpg", "txt")]).parent
    cfg = corpus.config(a, source__rows_per_part=2, source__also=[
        {"kind": "webdataset", "path": str(b), "name": "shards"}])
    keys = _keys(cfg, tmp_path)
    assert keys == [("a", f"{i}.jpg#0") for i in range(5)] + [("shards", f"{i:03d}")
                                                              for i in range(3)]


def test_a_top_level_sources_list_is_source_with_also(tmp_path):
    items = [{"kind": "folder", "path": "a"}, {"kind": "webdataset", "path": "b", "name": "w"}]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"sources": items}))
    cfg = C.load(tmp_path / "c.yaml")
    assert cfg.source.path == str((tmp_path / "a").resolve())      # relative to the config file
    assert [s.path for s in cfg.source.also] == [str((tmp_path / "b").resolve())]
    (tmp_path / "both.yaml").write_text(yaml.safe_dump({"sources": items, "source": items[0]}))
    with pytest.raises(C.ConfigError, match="either `source`.*or a `sources` list"):
        C.load(tmp_path / "both.yaml")


def test_two_sources_of_one_name_are_a_config_error(tmp_path):
    with pytest.raises(C.ConfigError, match="source.name: two sources are named 'x'"):
        C.load(None, {"source": {"path": "/d/x", "also": [{"path": "/e/x"}]}})
    with pytest.raises(C.ConfigError, match=r"also\[0\].also: sources do not nest"):
        C.load(None, {"source": {"path": "/d/x", "also": [{"path": "/e/y", "also": [
            {"path": "/f/z"}]}]}})


def test_sample_depends_only_on_source_and_key_and_nests(tmp_path):
    rows = _rows(200)
    src = corpus.folder(tmp_path / "s", rows)

    def sampled(share, **kw):
        return {k for _, k in _keys(corpus.config(src, source__sample=share, **kw), tmp_path)}

    small, large = sampled(0.2), sampled(0.5)
    assert small < large and 20 <= len(small) <= 60 and 70 <= len(large) <= 130
    assert all(int(sample_id("s", k), 16) < 0.2 * 2 ** 64 for k in small)
    assert sampled(0.2, source__rows_per_part=7) == small              # not the parts
    random.Random(0).shuffle(rows)                                      # not the order
    corpus.write_csv(src / "captions.csv", ("image", "caption"), rows)
    assert sampled(0.2) == small
    assert sampled(1.0) == {f"{i}.jpg#0" for i in range(200)}
    with pytest.raises(C.ConfigError, match=r"source.sample: must be a share in \(0, 1\]"):
        corpus.config(src, source__sample=0.0)


@pytest.mark.parametrize("rows_per_part", [3, 100])
def test_limit_takes_the_first_records_and_plans_no_more_parts(tmp_path, rows_per_part):
    src = corpus.folder(tmp_path / "s", _rows(20))
    cfg = corpus.config(src, source__limit=7, source__rows_per_part=rows_per_part)
    assert [k for _, k in _keys(cfg, tmp_path)] == [f"{i}.jpg#0" for i in range(7)]
    specs = sources.plan(cfg.source, str(tmp_path / "_plan.parquet"))
    assert len(specs) == -(-7 // rows_per_part)
    both = corpus.config(src, source__limit=7, source__sample=0.5, source__rows_per_part=3)
    got = [k for _, k in _keys(both, tmp_path)]
    assert got == [k for k in (f"{i}.jpg#0" for i in range(20))
                   if int(sample_id("s", k), 16) < 0.5 * 2 ** 64][:7]


def test_limit_on_tar_shards_counts_by_reading(tmp_path):
    for s in range(3):
        corpus.write_tar(tmp_path / "w" / f"{s:03d}.tar",
                         [(f"{s}{i:02d}.{ext}", corpus.jpeg(seed=i) if ext == "jpg" else b"text")
                          for i in range(4) for ext in ("jpg", "txt")])
    cfg = corpus.config(tmp_path / "w", kind="webdataset", source__limit=6)
    assert [k for _, k in _keys(cfg, tmp_path)] == ["000", "001", "002", "003", "100", "101"]


def test_new_source_settings_keep_old_fingerprints_until_set(tmp_path):
    cfg = corpus.config(tmp_path)
    assert {"sample", "limit", "also"}.isdisjoint(stage_config(IngestStage, cfg)["source"])
    limited = stage_config(IngestStage, cfg.replace(**{"source.limit": 5}))["source"]
    assert limited["limit"] == 5


def test_a_run_over_two_sources_accounts_for_every_record_and_says_how_it_narrowed(tmp_path):
    a = corpus.folder(tmp_path / "a", _rows(30))
    b = corpus.folder(tmp_path / "b", _rows(10, "b") + [("missing.jpg", "gone")])
    cfg = corpus.config(a, run__run_dir=str(tmp_path / "run"), source__rows_per_part=8,
                        source__sample=0.5, source__also=[{"path": str(b), "limit": 4}])
    res = by_stage(run(cfg, dag=spine(), executor="local", log=quiet))
    t = ds.dataset(tmp_path / "run" / "ingest" / "data", format="parquet").to_table()
    names = t.column(F.SOURCE.name).to_pylist()
    n_a = sum(int(sample_id("a", f"{i}.jpg#0"), 16) < 2 ** 63 for i in range(30))
    assert names == ["a"] * n_a + ["b"] * 4
    assert res["ingest"].manifest[F.MK.ROWS_IN] == n_a + 4
    notes = " ".join(res["ingest"].info["notes"])
    assert "a 0.5 sample by sample_id" in notes and "at most its first 4 records" in notes


def test_cli_limit_applies_to_every_source(tmp_path, capsys):
    from vlcurate.pipeline.cli import main
    a = corpus.folder(tmp_path / "a", _rows(12))
    b = corpus.folder(tmp_path / "b", _rows(12, "b"))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "sources": [{"path": str(a)}, {"path": str(b)}],
        "run": {"run_dir": str(tmp_path / "run"), "stages": ["ingest", "ids"]},
        "export": {"drop": []}}))
    assert main(["run", str(tmp_path / "c.yaml"), "--limit", "3", "--executor", "local"]) == 0
    t = ds.dataset(tmp_path / "run" / "ingest" / "data", format="parquet").to_table()
    assert t.column(F.KEY.name).to_pylist() == ["0.jpg#0", "1.jpg#0", "2.jpg#0",
                                                "b0.jpg#0", "b1.jpg#0", "b2.jpg#0"]
