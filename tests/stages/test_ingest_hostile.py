"""Hostile inputs, in every source format: each record the source holds is exactly one row,
kept or rejected with the exact reason, and nothing raises or hangs.

Each case builds a source, runs the readers and the ingest stage on every part, and checks the
multiset of (key, reasons) against what the source really holds, record by record.
"""
from __future__ import annotations

import gzip
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from . import corpus, hostile
from .hostile import FOLDER, FORMATS, TARS, good
from vlcurate.pipeline.runner import build_stage
from vlcurate.schemas import F
from vlcurate.stages.ingest.keys import invent as inv
from vlcurate.schemas import reasons as R
from vlcurate.stages.ids import find_duplicates
from vlcurate.stages.ingest import IngestStage, readers
from vlcurate.stages.ingest.readers import SourceError

pytestmark = pytest.mark.timeout(60)
SECRET = b"SECRET-TOKEN=hunter2 "
LIMIT = 20_000          # source.max_image_bytes in the size cases


def run_ingest(cfg, tmp: Path) -> list[dict]:
    specs = readers.plan(cfg.source, tmp / "_plan" / "plan.parquet")
    stage, out = build_stage(IngestStage, cfg), []
    for s in specs:
        raw = readers.read_part(cfg.source, s)
        t = stage(raw)
        assert t.num_rows == raw.num_rows
        out += t.to_pylist()
    return out


def check(rows: list[dict], expected: list[tuple[str, list[str]]]) -> None:
    """Rows in (the records the source holds, one expected entry each) = kept + rejected, and
    every row has exactly its expected reasons; no detail ever shows a file's bytes."""
    kept = [r for r in rows if not r[F.REASONS.name]]
    assert len(kept) + (len(rows) - len(kept)) == len(expected) == len(rows)
    got = sorted((r[F.KEY.name], tuple(r[F.REASONS.name])) for r in rows)
    assert got == sorted((k, tuple(v)) for k, v in expected)
    for r in rows:
        assert "hunter2" not in (r[F.REASON_DETAIL.name] or "")
        assert r[F.REASONS.name] or r[F.IMAGE.name] is not None   # a kept row has its image


def expect(recs: list[dict]) -> list[tuple[str, list[str]]]:
    return [(r.get("out_key", r["key"]), r["expect"]) for r in recs]


def source(fmt: str, tmp: Path, recs: list[dict], **cfg):
    root = hostile.write(fmt, tmp / "src", recs)
    return hostile.config(fmt, root, **cfg)


# --- encodings ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_encodings(fmt, tmp_path):
    """Escaped / raw lone surrogates in captions, a non-UTF-8 key and image name, a BOM."""
    surrogate = "\ud800 a cat"              # a JSON "\\ud800" escape; CESU bytes elsewhere
    recs = [good("g0", 0),
            dict(good("s1", 1), caption=surrogate if fmt in ("jsonl", *TARS)
                 else surrogate.encode("utf-8", "surrogatepass"), expect=[R.NON_UTF8]),
            dict(good(b"k\xff", 2), name=b"k\xff.jpg", out_key="k\\xff"),
            dict(good("bom", 3), caption="\ufeffcaption with a BOM".encode()),
            dict(good("latin", 4), caption="caf\u00e9".encode("latin-1"), expect=[R.NON_UTF8])]
    if fmt == "jsonl":   # the key and image name as JSON escapes of surrogateescape'd bytes
        recs[2] = dict(recs[2], key="k\udcff", name="k\udcff.jpg")
        recs.append({"key": "esc", "expect": [R.MISSING_FILE], "line":
                     b'{"key": "esc", "image": "\\ud800.jpg", "caption": "ok"}'})
    root = hostile.write(fmt, tmp_path / "src", recs)
    if fmt in FOLDER:   # a BOM before the header
        p = root / f"captions.{fmt}"
        p.write_bytes(b"\xef\xbb\xbf" + p.read_bytes())
    rows = run_ingest(hostile.config(fmt, root), tmp_path)
    check(rows, expect(recs))
    by = {r[F.KEY.name]: r for r in rows}
    assert by["bom"][F.CAPTION.name] == "caption with a BOM"
    assert by["k\\xff"][F.IMAGE.name] == recs[2]["image"]


@pytest.mark.parametrize("fmt", (*FOLDER, "parquet"))
def test_nul_bytes_and_odd_names_in_paths(fmt, tmp_path):
    recs = [dict(good("g0", 0), name="g0.jpg", path="images/g0.jpg"),
            dict(good("nul", 1), name="a\0b.jpg", path="images/a\0b.jpg", expect=[R.MISSING_FILE]),
            dict(good("nl", 2), name="new\nline.jpg", path="images/new\nline.jpg")]
    root = hostile.write(fmt if fmt != "parquet" else "csv", tmp_path / "src", recs)
    if fmt == "parquet":
        hostile.write("parquet", root, recs)
    check(run_ingest(hostile.config(fmt, root), tmp_path), expect(recs))


# --- malformed tables -----------------------------------------------------------------------------
def test_csv_tsv_ragged_rows_stray_cr_and_unbalanced_quotes_never_swallow_records(tmp_path):
    for fmt, d in (("csv", b","), ("tsv", b"\t")):
        recs = [good("g0", 0), good("g1", 1)]
        lines = [d.join([b"r2", b"r2.jpg", b"a", b"extra"]) + b"\n",      # ragged: 4 fields
                 d.join([b"r3", b"r3.jpg"]) + b"\n",                       # ragged: 2 fields
                 d.join([b"cr", b"g0.jpg", b"a caption\rwith a CR"]) + b"\r\n",  # stray CR, CRLF
                 d.join([b"q5", b"g0.jpg", b'"an unbalanced quote']) + b"\n",
                 d.join([b"g6", b"g1.jpg", b"after the quote"]) + b"\n",
                 d.join([b"g7", b"g0.jpg", b'"a quoted' + d + b' caption"']) + b"\n",
                 d.join([b"ml", b"g1.jpg", b'"two\nlines"']) + b"\n",      # a legal newline
                 d.join([b"x9", b"g0.jpg", b'"closed"then text']) + b"\n",   # lenient
                 b"\n", b"   \n"]                                          # blank: no record
        root = tmp_path / fmt
        hostile._image_files(root, recs)
        hostile._folder_table(root, recs, fmt, lines)
        rows = run_ingest(hostile.config(fmt, root), tmp_path / f"{fmt}_run")
        bad = [R.BAD_RECORD, R.MISSING_CAPTION]
        check(rows, [("g0", []), ("g1", []), ("r2", bad), ("r3", bad), ("cr", []),
                     ("q5", bad), ("g6", []), ("g7", []), ("ml", []), ("x9", [])])
        by = {r[F.KEY.name]: r for r in rows}
        assert by["cr"][F.CAPTION.name] == "a caption with a CR"
        assert by["ml"][F.CAPTION.name] == "two lines"
        assert by["g7"][F.CAPTION.name] == ("a quoted, caption" if fmt == "csv"
                                             else "a quoted caption")   # (a tab is whitespace)
        assert "line 4" in by["r2"][F.REASON_DETAIL.name]
        assert by["x9"][F.CAPTION.name] == "closedthen text"   # as Python's csv and Arrow read it


def test_unclosed_quote_at_the_end_and_a_long_quoted_span(tmp_path):
    """A quote opened in a line and never closed, with many records after it: every one kept."""
    recs = [good("g0", 0)]
    lines = [b'q1,g0.jpg,"never closed\n'] + [f"k{i},g0.jpg,caption {i}\n".encode()
                                              for i in range(200)]
    hostile._image_files(tmp_path / "s", recs)
    hostile._folder_table(tmp_path / "s", recs, "csv", lines)
    rows = run_ingest(hostile.config("csv", tmp_path / "s"), tmp_path)
    check(rows, [("g0", []), ("q1", [R.BAD_RECORD, R.MISSING_CAPTION])]
          + [(f"k{i}", []) for i in range(200)])


def test_jsonl_broken_lines(tmp_path):
    recs = [good("g0", 0), good("g1", 1)]
    lines = [b'{"key": "t", "image": "g0.jpg"', b"[1, 2]", b"[" * 100_000 + b"]" * 100_000,
             b'{"key": 1e999999, "image": "g0.jpg", "caption": "big number"}',
             b"\xff\xfe not json", b'{"key": "g3", "image": "g1.jpg", "caption": "last"}']
    root = hostile.write("jsonl", tmp_path / "src", recs, extra_lines=[x + b"\n" for x in lines])
    with open(root / "captions.jsonl", "ab") as fh:
        fh.write(b'{"key": "cut", "image": "g0.jp')          # a last line with no newline
    bad = [R.BAD_RECORD, R.MISSING_CAPTION]
    rows = run_ingest(hostile.config("jsonl", root), tmp_path)
    line = [(inv(f"captions.jsonl:{n}"), bad) for n in range(10)]   # no key: by its line
    check(rows, [("g0", []), ("g1", []), line[3], line[4], line[5], ("Infinity", []), line[7],
                 ("g3", []), line[9]])


def test_parquet_corrupt_row_group_rejects_its_rows_and_keeps_the_rest(tmp_path):
    recs = [good(f"g{i}", i) for i in range(4)]
    root = tmp_path / "src"
    hostile.write("parquet", root, recs)
    t = pq.read_table(root / "data.parquet")
    pq.write_table(t, root / "data.parquet", row_group_size=2, compression="none")
    meta = pq.ParquetFile(root / "data.parquet").metadata
    at = meta.row_group(1).column(1).data_page_offset
    data = bytearray((root / "data.parquet").read_bytes())
    data[at:at + 64] = b"\xee" * 64
    (root / "data.parquet").write_bytes(bytes(data))
    rows = run_ingest(hostile.config("parquet", root), tmp_path)
    bad = [R.BAD_RECORD, R.MISSING_CAPTION]
    check(rows, [("g0", []), ("g1", []), ("g2", bad), ("g3", bad)])   # keys read on their own


@pytest.mark.parametrize("fmt", TARS)
def test_truncated_and_garbled_tars_keep_what_was_read(fmt, tmp_path):
    recs = [good("g0", 0), good("g1", 1), good("g2", 2)]
    root = hostile.write(fmt, tmp_path / "src", recs)
    full = (root / "00000.tar").read_bytes()
    off = corpus.tar_offsets(root / "00000.tar")
    (root / "00000.tar").write_bytes(full[:off["g1.jpg"][1] + 100])   # cut in g1's image
    hostile.write_tar(root / "00001.tar", hostile.tar_members([good("h0", 5), good("h1", 6)]))
    full = (root / "00001.tar").read_bytes()
    at = corpus.tar_offsets(root / "00001.tar")["h1.jpg"][0]
    (root / "00001.tar").write_bytes(full[:at] + b"garbage!" * 64 + full[at + 512:])
    bad = [R.BAD_RECORD, R.MISSING_CAPTION]
    rows = run_ingest(hostile.config(fmt, root), tmp_path)
    check(rows, [("g0", []), (inv("00000.tar:<unreadable>"), bad), ("h0", []),
                 (inv("00001.tar:<unreadable>"), bad)])


# --- files that are not what their name says ------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_files_beside_good_ones_and_no_file_bytes_in_details(fmt, tmp_path):
    recs = [good("g0", 0), dict(good("junk", 1), image=SECRET * 20, expect=[R.UNDECODABLE])]
    root = hostile.write(fmt, tmp_path / "src", recs)
    expected = expect(recs)
    bad = [R.BAD_FILE, R.MISSING_CAPTION]
    if fmt == "parquet":
        (root / "zz.parquet").write_bytes(SECRET * 50)
        (root / "empty.parquet").write_bytes(b"")
        expected += [(inv("zz.parquet:<bad_file>"), bad), (inv("empty.parquet:<bad_file>"), bad)]
    elif fmt in TARS:
        (root / "00001.tar").write_bytes(SECRET * 50)
        (root / "00002.tar").write_bytes(b"")
        expected += [(inv("00001.tar:<unreadable>"), bad), (inv("00002.tar:<unreadable>"), bad)]
        if fmt == "img2dataset":
            (root / "00001.parquet").write_bytes(SECRET * 50)
            expected += [(inv("00001.parquet:<bad_file>"), bad)]
    rows = run_ingest(hostile.config(fmt, root), tmp_path)
    check(rows, expected)
    for r in rows:
        assert "SECRET" not in (r[F.REASON_DETAIL.name] or "") + (r[F.EXTRA.name] or "")


def test_a_junk_captions_file_is_a_source_error(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for seed in range(40):
        (root / "captions.csv").write_bytes(random.Random(seed).randbytes(5000))
        with pytest.raises(SourceError, match="no column|no records"):
            readers.plan(corpus.config(root).source, tmp_path / "plan.parquet")


# --- sizes and special files ----------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_files_over_max_image_bytes_are_never_read(fmt, tmp_path):
    big = dict(good("big", 1), image=b"\xff" * (LIMIT + 1), expect=[R.FILE_TOO_LARGE])
    at = dict(good("at", 2), image=corpus.jpeg(32, 24, seed=2) + b"\0" * 100)
    at["image"] += b"\0" * (LIMIT - len(at["image"]))     # exactly the limit: read
    recs = [good("g0", 0), big, at]
    rows = run_ingest(source(fmt, tmp_path, recs, source__max_image_bytes=LIMIT), tmp_path)
    check(rows, expect(recs))


def test_parquet_row_group_declaring_more_than_the_limit_is_not_read(tmp_path):
    recs = [dict(good("big", 1), image=bytes(4 << 20))]   # 4 MiB of zeros: a small file
    root = hostile.write("parquet", tmp_path / "src", recs)
    assert (root / "data.parquet").stat().st_size < 500_000
    rows = run_ingest(hostile.config("parquet", root, source__max_image_bytes=LIMIT), tmp_path)
    check(rows, [(inv("data.parquet:0"), [R.FILE_TOO_LARGE, R.MISSING_CAPTION])])
    assert "declares" in rows[0][F.REASON_DETAIL.name]


@pytest.mark.parametrize("fmt", FORMATS)
def test_fifos_devices_and_links_are_never_opened(fmt, tmp_path):
    recs = [good("g0", 0), dict(good("fifo", 1), image=None, special="fifo",
                                expect=[R.SPECIAL_FILE])]
    if fmt in TARS:
        recs += [dict(good(k, 2), image=None, special=s, expect=[R.SPECIAL_FILE])
                 for k, s in (("sym", "symlink:/etc/passwd"), ("hard", "hardlink"),
                              ("dev", "device"))]
        recs.append(dict(good("sparse", 3), special="sparse", expect=[R.SPECIAL_FILE]))
    root = tmp_path / "src"
    if fmt == "parquet":   # image paths to a FIFO (inside the source) and to a device
        hostile._image_files(root, recs)
        recs = [dict(recs[0], path="images/g0.jpg"), dict(recs[1], path="images/fifo.jpg"),
                dict(good("dev", 3), path="/dev/zero", expect=[R.SPECIAL_FILE])]
        hostile.write("parquet", root, recs)
    else:
        hostile.write(fmt, root, recs)
    expected = expect(recs)
    if fmt in TARS or fmt == "parquet":   # a FIFO where a shard / parquet file should be
        name = "00009.tar" if fmt in TARS else "zz.parquet"
        os.mkfifo(root / name)
        key = inv(f"{name}:<unreadable>" if fmt in TARS else f"{name}:<bad_file>")
        expected.append((key, [R.SPECIAL_FILE, R.MISSING_CAPTION]))
    cfg = hostile.config(fmt, root, source__allow_outside_source=fmt == "parquet")
    check(run_ingest(cfg, tmp_path), expected)


def test_symlink_to_a_device_inside_a_folder(tmp_path):
    recs = [good("g0", 0), dict(good("dev", 1), image=None, special="symlink:/dev/zero")]
    root = hostile.write("csv", tmp_path / "src", recs)
    rows = run_ingest(hostile.config("csv", root), tmp_path)
    check(rows, [("g0", []), ("dev", [R.OUTSIDE_SOURCE])])
    rows = run_ingest(hostile.config("csv", root, source__allow_outside_source=True), tmp_path)
    check(rows, [("g0", []), ("dev", [R.SPECIAL_FILE])])


# --- tar members ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_duplicate_keys_are_two_rows_and_the_ids_stage_flags_the_later(fmt, tmp_path):
    recs = [good("a", 0), good("b", 1), good("a", 2)]            # not adjacent
    if fmt in TARS:                                               # adjacent: a.jpg a.txt a.jpg ...
        recs += [good("c", 3), dict(good("c", 4), caption=b"the second c")]
    if fmt in FOLDER:
        for i, r in enumerate(recs):
            r["name"] = f"{r['key']}{i}.jpg"
    rows = run_ingest(source(fmt, tmp_path, recs), tmp_path)
    check(rows, expect(recs))
    t = pa.Table.from_pylist([{F.SAMPLE_ID.name: r[F.SAMPLE_ID.name], F.ROW.name: i}
                              for i, r in enumerate(rows)])
    dups = find_duplicates(lambda p: t, 1)[0]
    assert sorted(dups) == ([2, 4] if fmt in TARS else [2])


@pytest.mark.parametrize("fmt", TARS)
def test_concatenated_and_gzip_tars_are_read(fmt, tmp_path):
    root = tmp_path / "src"
    a = hostile.write_tar(tmp_path / "a.tar", hostile.tar_members([good("a0", 0), good("a1", 1)]))
    b = hostile.write_tar(tmp_path / "b.tar", hostile.tar_members([good("b0", 2)]))
    root.mkdir()
    (root / "00000.tar").write_bytes(a.read_bytes() + b.read_bytes())   # cat a.tar b.tar
    c = hostile.write_tar(tmp_path / "c.tar", hostile.tar_members([good("c0", 3)]))
    d = hostile.write_tar(tmp_path / "d.tar", hostile.tar_members([good("d0", 4), good("d1", 5)]))
    (root / "00001.tar.gz").write_bytes(gzip.compress(c.read_bytes()))
    (root / "00002.tgz").write_bytes(gzip.compress(d.read_bytes()))
    (root / "00003.tar").write_bytes(a.read_bytes() + b"trailing junk")
    if fmt == "img2dataset":
        hostile.i2d_status(root, [])
    rows = run_ingest(hostile.config(fmt, root), tmp_path)
    check(rows, [("a0", []), ("a1", []), ("b0", []), ("c0", []), ("d0", []), ("d1", []),
                 ("a0", []), ("a1", []),
                 (inv("00003.tar:<unreadable>"), [R.BAD_RECORD, R.MISSING_CAPTION])])


# --- captions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_invisible_only_captions_are_empty(fmt, tmp_path):
    recs = [good("g0", 0, caption="a \u200dcat\u200b".encode()),
            dict(good("zw", 1), caption="\u200b\u200c\u200d\u2060\ufeff".encode(),
                 expect=[R.EMPTY_CAPTION]),
            dict(good("bidi", 2), caption="\u200e\u202a\u2066\u00ad \u3164\u2800".encode(),
                 expect=[R.EMPTY_CAPTION]),
            dict(good("tags", 3), caption="\U000e0041\U000e0062\ufe0f".encode(),
                 expect=[R.EMPTY_CAPTION])]
    rows = run_ingest(source(fmt, tmp_path, recs), tmp_path)
    check(rows, expect(recs))
    assert {r[F.KEY.name]: r[F.CAPTION.name] for r in rows}["g0"] == "a \u200dcat\u200b"


@pytest.mark.parametrize("fmt", ("jsonl", *TARS))
def test_json_captions_that_are_not_strings(fmt, tmp_path):
    recs = [good("g0", 0, caption="a string")]
    recs += [dict(good(f"c{i}", i + 1), caption=v, expect=[R.BAD_CAPTION])
             for i, v in enumerate([["a", "list"], {"text": "an object"}, 3, True, 2.5])]
    rows = run_ingest(source(fmt, tmp_path, recs), tmp_path)
    check(rows, expect(recs))
    assert all(r[F.IMAGE.name] for r in rows)       # the image is still decoded and checked
    assert all(r[F.CAPTION.name] is None for r in rows if r[F.REASONS.name])


def test_parquet_list_caption_column_is_a_config_error_or_its_first_element(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    pq.write_table(pa.table({"key": ["a", "b", "c"],
                             "image": [corpus.jpeg(32, 24, seed=i) for i in range(3)],
                             "caption": [["first", "second"], [], None]}), root / "d.parquet")
    with pytest.raises(SourceError, match="list<.*caption_list: first"):
        run_ingest(hostile.config("parquet", root), tmp_path)
    rows = run_ingest(hostile.config("parquet", root, source__caption_list="first"), tmp_path)
    check(rows, [("a", []), ("b", [R.MISSING_CAPTION]), ("c", [R.MISSING_CAPTION])])
    assert rows[0][F.CAPTION.name] == "first"
    pq.write_table(pa.table({"key": ["a"], "image": [b"x"], "caption": [3]}), root / "d.parquet")
    with pytest.raises(SourceError, match="int64, not a string"):
        run_ingest(hostile.config("parquet", root), tmp_path)


# --- paths ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", (*FOLDER, "parquet", "img2dataset"))
def test_paths_outside_the_source_are_rejected_unless_allowed(fmt, tmp_path):
    outside = tmp_path / "outside.jpg"
    outside.write_bytes(corpus.jpeg(32, 24, seed=9))
    root = tmp_path / "src"
    if fmt == "img2dataset":   # the files layout: a symlink in a shard folder
        (root / "00000").mkdir(parents=True)
        (root / "00000" / "g0.jpg").write_bytes(corpus.jpeg(32, 24, seed=0))
        (root / "00000" / "g0.txt").write_bytes(b"inside")
        os.symlink(outside, root / "00000" / "esc.jpg")
        (root / "00000" / "esc.txt").write_bytes(b"outside")
        expected = [("g0", []), ("esc", [R.OUTSIDE_SOURCE])]
    else:
        recs = [dict(good("g0", 0), name="g0.jpg", path="images/g0.jpg"),
                dict(good("dots", 1), image=None, name="../../outside.jpg",
                     path="../outside.jpg", expect=[R.OUTSIDE_SOURCE]),
                dict(good("abs", 2), image=None, name=str(outside), path=str(outside),
                     expect=[R.OUTSIDE_SOURCE]),
                dict(good("link", 3), image=None, special=f"symlink:{outside}",
                     path="images/link.jpg", expect=[R.OUTSIDE_SOURCE])]
        hostile.write(fmt if fmt != "parquet" else "csv", root, recs)
        if fmt == "parquet":
            hostile.write("parquet", root, recs)
        expected = expect(recs)
    check(run_ingest(hostile.config(fmt, root), tmp_path), expected)
    allowed = run_ingest(hostile.config(fmt, root, source__allow_outside_source=True), tmp_path)
    check(allowed, [(k, []) for k, _ in expected])
    assert all(r[F.IMAGE.name] for r in allowed)


# --- empty or wrong sources -----------------------------------------------------------------------
def _empty(fmt: str, root: Path) -> None:
    root.mkdir(parents=True)
    if fmt in ("csv", "tsv"):
        (root / f"captions.{fmt}").write_bytes(b"key,image,caption\n")
    elif fmt == "jsonl":
        (root / "captions.jsonl").write_bytes(b"\n\n")
    elif fmt == "parquet":
        pq.write_table(pa.table({"key": pa.array([], pa.string()),
                                 "image": pa.array([], pa.binary()),
                                 "caption": pa.array([], pa.string())}), root / "d.parquet")
    else:
        hostile.write_tar(root / "00000.tar", [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_empty_source_is_an_error_before_any_part_runs(fmt, tmp_path):
    _empty(fmt, tmp_path / "src")
    with pytest.raises(SourceError, match="no records"):
        readers.plan(hostile.config(fmt, tmp_path / "src").source, tmp_path / "plan.parquet")


@pytest.mark.parametrize("fmt,wrong,hint", [
    ("parquet", "webdataset", "1 .parquet file(s)"), ("webdataset", "parquet", "1 .tar shard(s)"),
    ("parquet", "csv", "1 .parquet file(s)"), ("csv", "parquet", "1 captions file(s)"),
    ("jsonl", "img2dataset", "1 captions file(s)")])
def test_the_wrong_kind_for_the_files_is_an_error_that_says_so(fmt, wrong, hint, tmp_path):
    root = hostile.write(fmt, tmp_path / "src", [good("g0", 0)])
    cfg = hostile.config(wrong, root, source__captions_file=None)
    with pytest.raises(SourceError) as e:
        readers.plan(cfg.source, tmp_path / "plan.parquet")
    assert hint in str(e.value) and "source.kind" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt", ("parquet", "webdataset"))
def test_compression_bombs_under_the_size_limit_are_never_expanded(fmt, tmp_path):
    """5 MiB of zeros is under max_image_bytes (64 MiB) but declares > 100x its file's bytes."""
    root = tmp_path / "src"
    root.mkdir()
    zeros = bytes(5 << 20)
    if fmt == "parquet":
        pq.write_table(pa.table({"key": ["z"], "image": pa.array([zeros], pa.binary()),
                                 "caption": ["zeros"]}), root / "data.parquet",
                       compression="zstd", use_dictionary=False)
        expected = [(inv("data.parquet:0"), [R.FILE_TOO_LARGE, R.MISSING_CAPTION])]
    else:
        tar = hostile.write_tar(tmp_path / "z.tar", hostile.tar_members(
            [dict(good("z", 0), image=zeros), good("g1", 1)]))
        (root / "00000.tar.gz").write_bytes(gzip.compress(tar.read_bytes()))
        expected = [("z", [R.FILE_TOO_LARGE]), ("g1", [])]
    rows = run_ingest(hostile.config(fmt, root), tmp_path)
    check(rows, expected)
    assert "compression bomb" in rows[0][F.REASON_DETAIL.name]


def test_a_socket_is_never_opened_and_a_fifo_captions_file_is_a_source_error(tmp_path):
    import socket
    recs = [good("g0", 0), dict(good("sock", 1), image=None)]
    root = hostile.write("csv", tmp_path / "src", recs)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(root / "images" / "sock.jpg"))
    try:
        check(run_ingest(hostile.config("csv", root), tmp_path),
              [("g0", []), ("sock", [R.SPECIAL_FILE])])
    finally:
        s.close()
    (root / "captions.csv").unlink()
    os.mkfifo(root / "captions.csv")       # never waited on
    with pytest.raises(SourceError, match="is a FIFO"):
        readers.plan(hostile.config("csv", root).source, tmp_path / "plan.parquet")


def test_img2dataset_files_and_parquet_layouts(tmp_path):
    """The other two img2dataset layouts: a FIFO, an oversized and a junk image, an invisible
    caption and a failed download in each, and a junk parquet beside the parquet layout."""
    files = tmp_path / "files"
    (files / "00000").mkdir(parents=True)
    d = files / "00000"
    (d / "g0.jpg").write_bytes(corpus.jpeg(32, 24, seed=0))
    (d / "g0.txt").write_bytes(b"good")
    os.mkfifo(d / "fifo.jpg")
    (d / "fifo.txt").write_bytes(b"a fifo")
    (d / "big.jpg").write_bytes(b"\xff" * (LIMIT + 1))
    (d / "big.txt").write_bytes(b"too big")
    (d / "junk.jpg").write_bytes(SECRET * 10)
    (d / "junk.txt").write_bytes(b"junk")
    (d / "zw.jpg").write_bytes(corpus.jpeg(32, 24, seed=1))
    (d / "zw.txt").write_bytes("\u200b".encode())
    pq.write_table(pa.table({"key": ["gone"], "url": ["http://x"], "caption": ["lost"],
                             "status": ["failed_to_download"], "error_message": ["404"]}),
                   files / "00000.parquet")
    expected = [("g0", []), ("fifo", [R.SPECIAL_FILE]), ("big", [R.FILE_TOO_LARGE]),
                ("junk", [R.UNDECODABLE]), ("zw", [R.EMPTY_CAPTION]),
                ("gone", [R.DOWNLOAD_FAILED])]
    check(run_ingest(corpus.config(files, "img2dataset", source__max_image_bytes=LIMIT),
                     tmp_path / "f"), expected)

    par = tmp_path / "parquet"
    par.mkdir()
    images = [corpus.jpeg(32, 24, seed=0), b"\xff" * (LIMIT + 1), SECRET * 10,
              corpus.jpeg(32, 24, seed=1), None]
    pq.write_table(pa.table({"key": ["g0", "big", "junk", "zw", "gone"],
                             "jpg": pa.array(images, pa.binary()),
                             "caption": ["good", "too big", "junk", "\u200b", "lost"],
                             "status": ["success"] * 4 + ["failed_to_download"],
                             "error_message": [None] * 4 + ["404"]}), par / "00000.parquet")
    (par / "00001.parquet").write_bytes(SECRET * 30)
    expected = [e for e in expected if e[0] != "fifo"] + [
        (inv("00001.parquet:<bad_file>"), [R.BAD_FILE, R.MISSING_CAPTION])]
    check(run_ingest(corpus.config(par, "img2dataset", source__max_image_bytes=LIMIT),
                     tmp_path / "p"), expected)
