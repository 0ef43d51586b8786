"""The books through ``vlcurate run``: every record an img2dataset or captions source holds is a
row with its exact reason, invented keys never take a real key's place, and the rows balance
against the source's second count; a reader that loses a record fails the run, naming the file."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml

from . import corpus, hostile
from .hostile import good
from vlcurate.pipeline.cli import main
from vlcurate.schemas import F
from vlcurate.schemas import reasons as R
from vlcurate.stages.ingest import census, readers, sources
from vlcurate.stages.ingest.keys import invent

pytestmark = pytest.mark.timeout(180)
LOOKS_INVENTED = invent("captions.csv:4")      # a real key equal to the one invented for line 4


def _status(path: Path, rows: list[tuple[str, str]]) -> None:
    keys = [k for k, _ in rows]
    pq.write_table(pa.table({"key": keys, "url": [f"http://x/{k}" for k in keys],
                             "caption": ["c"] * len(rows), "status": [s for _, s in rows],
                             "error_message": [None if s == "success" else "404"
                                               for _, s in rows]}), path)


def _i2d(root: Path) -> None:
    """00000: a0, a1 downloaded and in the tar, a2 downloaded but not in it, a3 failed, x9 in
    the tar only; 00001: a status file whose tar is missing (b0 downloaded, b1 failed)."""
    hostile.write_tar(root / "00000.tar", hostile.tar_members(
        [good("a0", 0), good("a1", 1), good("x9", 2)]))
    _status(root / "00000.parquet", [("a0", "success"), ("a1", "success"), ("a2", "success"),
                                     ("a3", "failed_to_download")])
    _status(root / "00001.parquet", [("b0", "success"), ("b1", "failed_to_download")])


def _captions(root: Path) -> None:
    """A real key that looks invented (line 2), a keyless record (line 4: its key is invented
    as that same string), a ragged row and an unbalanced quote with readable keys."""
    hostile._image_files(root, [good("g1", 1)])
    (root / "captions.csv").write_bytes(
        b"key,image,caption\n"
        + LOOKS_INVENTED.encode() + b",g1.jpg,a real key that looks made up\n"
        b"g1,g1.jpg,a plain record\n"
        b",g1.jpg,a record without a key\n"
        b"r5,g1.jpg,ragged,row\n"
        b'q6,g1.jpg,"an unbalanced quote\n')


def _keyless(root: Path) -> None:
    """A tar with a keyless sample (``.jpg``) beside one keyed ``∅x``; a Parquet file whose
    row 0 has a real key equal to the one invented for its keyless row 1."""
    hostile.write_tar(root / "wds" / "00000.tar", hostile.tar_members(
        [good(b"", 3), good("\u2205x", 4)]))
    pq.write_table(pa.table({"key": [invent("pq.parquet:1"), None],
                             "image": [corpus.jpeg(16, 16, seed=5)] * 2, "caption": ["c"] * 2}),
                   root / "pq.parquet")


def _run(tmp_path: Path, capsys) -> tuple[int, str, dict]:
    (tmp_path / "i2d").mkdir()
    _i2d(tmp_path / "i2d")
    _captions(tmp_path / "csv")
    _keyless(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "sources": [{"kind": "img2dataset", "path": str(tmp_path / "i2d"), "name": "i2d"},
                    {"kind": "folder", "path": str(tmp_path / "csv"), "name": "csv",
                     "key_column": "key"},
                    {"kind": "webdataset", "path": str(tmp_path / "wds"), "name": "wds"},
                    {"kind": "parquet", "path": str(tmp_path / "pq.parquet"), "name": "pq",
                     "key_column": "key"}],
        "run": {"run_dir": str(tmp_path / "run"), "progress": False, "stages": ["ids"],
                "max_reject_fraction": 1.0}}))
    code = main(["run", str(config), "--executor", "local"])
    out = capsys.readouterr().out
    rows = ds.dataset(tmp_path / "run" / "ingest" / "data", format="parquet").to_table()
    return code, out, {(r[F.SOURCE.name], r[F.KEY.name]): r for r in rows.to_pylist()}


def test_every_record_is_a_row_with_its_reason_and_the_books_balance(tmp_path, capsys):
    code, out, rows = _run(tmp_path, capsys)
    assert code == 0, out
    got = {k: r[F.REASONS.name] for k, r in rows.items()}
    missing, failed = [R.MISSING_FILE], [R.DOWNLOAD_FAILED]
    assert got == {
        ("i2d", "a0"): [], ("i2d", "a1"): [], ("i2d", "x9"): [],   # x9: in no status file, kept
        ("i2d", "a2"): missing, ("i2d", "a3"): failed,              # a2: success, not in its tar
        ("i2d", "b0"): missing, ("i2d", "b1"): failed,              # 00001.tar is missing
        ("csv", "\u2205" + LOOKS_INVENTED): [], ("csv", "g1"): [], ("csv", LOOKS_INVENTED): [],
        ("csv", "r5"): [R.BAD_RECORD, R.MISSING_CAPTION],
        ("csv", "q6"): [R.BAD_RECORD, R.MISSING_CAPTION],
        ("wds", invent("00000.tar:0")): [], ("wds", "\u2205\u2205x"): [],
        ("pq", "\u2205" + invent("pq.parquet:1")): [], ("pq", invent("pq.parquet:1")): []}
    assert "no sample in 00000.tar" in rows[("i2d", "a2")][F.REASON_DETAIL.name]
    assert "no sample in 00001.tar" in rows[("i2d", "b0")][F.REASON_DETAIL.name]
    assert "2 fields, the header has 3" not in rows[("csv", "r5")][F.REASON_DETAIL.name]
    assert "4 fields, the header has 3" in rows[("csv", "r5")][F.REASON_DETAIL.name]
    invented = sorted(k for k, r in rows.items() if r[F.KEY_INVENTED.name])
    assert invented == [("csv", LOOKS_INVENTED), ("pq", invent("pq.parquet:1")),
                        ("wds", invent("00000.tar:0"))]
    assert len({r[F.SAMPLE_ID.name] for r in rows.values()}) == len(rows) == 16
    # the second count, written beside the plan, says the same and the summary says so
    books = json.loads((tmp_path / "run" / "ingest" / "_census.json").read_text())
    counts = {Path(u).name: c[:2] for b in books for u, c in b["counts"].items()}
    # (an unbalanced quote: Python's csv cannot parse the file, so the count is a bound)
    assert counts == {"00000.parquet": [5, 5], "00001.parquet": [2, 2], "captions.csv": [1, 5],
                      "00000.tar": [2, 2], "pq.parquet": [2, 2]}
    assert "for every stage, no row lost: yes\n  (ingest's rows checked against the sources' " \
           "second count: 11 records in 4 files; 1 malformed file(s) within bounds)" in out, out


def test_a_record_the_reader_loses_fails_the_run_naming_the_file(tmp_path, capsys, monkeypatch):
    lose = readers._with_statuses

    def drops_the_last_status_row(rows, names, parquet, shard):   # the bug this check catches
        out = lose(rows, names, parquet, shard)
        return out[:-1] if parquet.name == "00000.parquet" else out
    monkeypatch.setattr(readers, "_with_statuses", drops_the_last_status_row)
    code, out, rows = _run(tmp_path, capsys)
    assert code == 1 and ("i2d", "a3") not in rows
    assert "no row lost: NO" in out, out
    assert f"ingest: {tmp_path / 'i2d' / '00000.parquet'}: 4 rows in, the second count says 5" \
        in out, out


def test_img2dataset_files_layout_every_status_row_is_a_row(tmp_path):
    """The files layout (a folder per shard): the same rules as the tar layout."""
    root = tmp_path / "src"
    (root / "00000").mkdir(parents=True)
    for key in ("a0", "x9"):
        (root / "00000" / f"{key}.jpg").write_bytes(corpus.jpeg(16, 16, seed=1))
        (root / "00000" / f"{key}.txt").write_bytes(b"a caption")
    _status(root / "00000.parquet", [("a0", "success"), ("a2", "success"), ("a3", "failed")])
    _status(root / "00001.parquet", [("b0", "success"), (None, "failed")])   # no 00001/
    cfg = corpus.config(root, "img2dataset").source
    specs = sources.plan(cfg, str(tmp_path / "_plan.parquet"))
    parts = [sources.read_part(cfg, s).to_pylist() for s in specs]
    got = {r[F.KEY.name]: r[F.READ_ERROR.name] for p in parts for r in p}
    assert got == {"a0": None, "x9": None, "a2": R.MISSING_FILE, "a3": R.DOWNLOAD_FAILED,
                   "b0": R.MISSING_FILE, invent("00001.parquet:1"): R.DOWNLOAD_FAILED}
    books = census.count_all(json.loads((tmp_path / sources.CENSUS).read_text()))
    assert census.check(books, [len(p) for p in parts])["lost"] == []
    assert census.check(books, [len(p) - 1 for p in parts])["lost"] == [   # a lost row: named
        f"{root / '00000.parquet'}: 3 rows in, the second count says 4",
        f"{root / '00001.parquet'}: 1 rows in, the second count says 2"]


@pytest.mark.parametrize("narrow,checked", [({"source__limit": 3}, True),
                                            ({"source__max_captions_per_image": 1}, True),
                                            ({"source__sample": 0.5}, False)])
def test_a_narrowed_source_is_checked_as_a_whole_or_said_unchecked(narrow, checked, tmp_path):
    src = corpus.folder(tmp_path / "s", [("a.jpg", f"caption {i}") for i in range(5)])
    cfg = corpus.config(src, **narrow).source
    specs = sources.plan(cfg, str(tmp_path / "_plan.parquet"))
    rows = [sources.read_part(cfg, s).num_rows for s in specs]
    books = census.count_all(json.loads((tmp_path / sources.CENSUS).read_text()))
    got = census.check(books, rows)
    assert got["lost"] == [] and got["unchecked"] == ([] if checked else ["s"])
    lost = census.check(books, [rows[0] + 9] + rows[1:])["lost"]      # rows the source never had
    assert lost == ([f"source 's': {sum(rows) + 9} rows in, the second count says "
                     + ("3" if "source__limit" in narrow else "0 to 5")] if checked else [])
