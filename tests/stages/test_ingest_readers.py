"""stages/ingest/readers.py: plan a source into parts, read each part into raw records."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from . import corpus
from vlcurate.pipeline.runner import build_stage
from vlcurate.schemas import F, tables
from vlcurate.schemas import reasons as R
from vlcurate.stages.ingest import IngestStage, readers
from vlcurate.stages.ingest.keys import invent as inv
from vlcurate.stages.ingest.readers import SourceError


def read_all(cfg, tmp: Path) -> tuple[list[dict], list[pa.Table]]:
    specs = readers.plan(cfg.source, tmp / "plan.parquet")
    assert [s["part"] for s in specs] == list(range(len(specs)))
    parts = [readers.read_part(cfg.source, s) for s in specs]
    for t in parts:
        assert t.schema == tables.RAW_RECORDS
    return specs, parts


def rows_of(cfg, tmp: Path) -> list[dict]:
    _, parts = read_all(cfg, tmp)
    return [r for t in parts for r in t.to_pylist()]


def col(rows: list[dict], field: pa.Field) -> list:
    return [r[field.name] for r in rows]


# --- folder + CSV ---------------------------------------------------------------------------------
def test_folder_csv_defaults(tmp_path):
    images = {"a.jpg": corpus.jpeg(seed=1), "b.jpg": corpus.jpeg(seed=2)}
    src = corpus.folder(tmp_path / "my_photos", [("a.jpg", "one"), ("b.jpg", "two"),
                                                 ("a.jpg", "three")], images=images)
    rows = rows_of(corpus.config(src), tmp_path)
    assert col(rows, F.KEY) == ["a.jpg#0", "b.jpg#0", "a.jpg#1"]
    assert col(rows, F.SOURCE) == ["my_photos"] * 3          # default: the folder's name
    assert col(rows, F.IMAGE_REF) == ["a.jpg", "b.jpg", "a.jpg"]
    assert col(rows, F.RAW_IMAGE) == [images["a.jpg"], images["b.jpg"], images["a.jpg"]]
    assert col(rows, F.RAW_CAPTION) == [b"one", b"two", b"three"]
    assert col(rows, F.READ_ERROR) == [None] * 3
    assert col(rows, F.EXTRA) == [None] * 3


def test_source_name_from_config(tmp_path):
    src = corpus.folder(tmp_path / "x", [("a.jpg", "one")])
    rows = rows_of(corpus.config(src, source__name="laion-sample"), tmp_path)
    assert col(rows, F.SOURCE) == ["laion-sample"]
    assert readers.source_name(corpus.config(str(src) + "/").source) == "x"


def test_configurable_columns_and_extra_json(tmp_path):
    root = tmp_path / "src"
    (root / "images").mkdir(parents=True)
    (root / "images" / "p1.jpg").write_bytes(corpus.jpeg(seed=1))
    (root / "images" / "p2.jpg").write_bytes(corpus.jpeg(seed=2))
    corpus.write_csv(root / "captions.csv", ["id", "file", "text", "license", "unused"],
                     [("x1", "p1.jpg", "first", "cc-by", "zzz"),
                      ("x2", "p2.jpg", "second", "", "zzz"),
                      ("", "p1.jpg", "no id", "cc0", "zzz")])
    cfg = corpus.config(root, source__image_column="file", source__caption_column="text",
                        source__key_column="id", source__extra_columns=["license", "id"])
    rows = rows_of(cfg, tmp_path)
    assert col(rows, F.KEY) == ["x1", "x2", inv("captions.csv:4")]   # no key: invented from the line
    assert col(rows, F.RAW_CAPTION) == [b"first", b"second", b"no id"]
    assert [json.loads(e) for e in col(rows, F.EXTRA)] == [
        {"id": "x1", "license": "cc-by"}, {"id": "x2", "license": ""}, {"id": "", "license": "cc0"}]
    assert all(r[F.RAW_IMAGE.name] for r in rows)


def test_max_captions_per_image(tmp_path):
    src = corpus.folder(tmp_path / "s", [("a.jpg", "a one"), ("a.jpg", "a two"), ("b.jpg", "b one"),
                                          ("a.jpg", "a three"), ("b.jpg", "b two")])
    rows = rows_of(corpus.config(src, source__max_captions_per_image=1), tmp_path)
    assert col(rows, F.KEY) == ["a.jpg#0", "b.jpg#0"]
    assert col(rows, F.RAW_CAPTION) == [b"a one", b"b one"]
    rows = rows_of(corpus.config(src, source__max_captions_per_image=2), tmp_path)
    assert col(rows, F.KEY) == ["a.jpg#0", "a.jpg#1", "b.jpg#0", "b.jpg#1"]


def test_rows_per_part_splits_the_plan_into_parts(tmp_path):
    names = [f"{i}.jpg" for i in range(5)]
    src = corpus.folder(tmp_path / "s", [(n, f"caption {n}") for n in names])
    specs, parts = read_all(corpus.config(src, source__rows_per_part=2), tmp_path)
    assert len(specs) == 3
    assert [t.num_rows for t in parts] == [2, 2, 1]
    assert [r[F.KEY.name] for t in parts for r in t.to_pylist()] == [f"{n}#0" for n in names]
    # the plan is JSON-able (it travels to Ray tasks)
    assert json.loads(json.dumps(specs)) == specs
    specs, parts = read_all(corpus.config(src), tmp_path)
    assert len(specs) == 1 and parts[0].num_rows == 5


def test_header_only_csv_is_an_error_not_a_0_row_success(tmp_path):
    src = corpus.folder(tmp_path / "s", [], images={})
    with pytest.raises(SourceError, match="no records"):
        readers.plan(corpus.config(src).source, tmp_path / "plan.parquet")


def test_csv_cells_are_kept_as_raw_bytes(tmp_path):
    captions = [b'a "quoted", comma\nand a newline', "caf\u00e9".encode("latin-1"),
                "\ufeffna\u00efve \u2603".encode()]
    src = corpus.folder(tmp_path / "s", [("a.jpg", c) for c in captions])
    rows = rows_of(corpus.config(src), tmp_path)
    assert col(rows, F.RAW_CAPTION) == captions


def test_csv_with_bom_tsv_images_dir_and_captions_file(tmp_path):
    root = tmp_path / "s"
    root.mkdir()
    (root / "a.jpg").write_bytes(corpus.jpeg(seed=1))
    corpus.write_csv(root / "captions.csv", ["image", "caption"], [("a.jpg", "with bom")], bom=True)
    rows = rows_of(corpus.config(root, source__images_dir=""), tmp_path)
    assert col(rows, F.RAW_CAPTION) == [b"with bom"] and rows[0][F.RAW_IMAGE.name]

    (root / "captions.csv").unlink()
    corpus.write_csv(root / "captions.tsv", ["image", "caption"], [("a.jpg", "x, y")],
                     delimiter=b"\t")
    rows = rows_of(corpus.config(root, source__images_dir=""), tmp_path)
    assert col(rows, F.RAW_CAPTION) == [b"x, y"] and rows[0][F.READ_ERROR.name] is None

    meta = corpus.write_csv(tmp_path / "elsewhere" / "meta.csv", ["image", "caption"],
                            [("a.jpg", "absolute")])
    rows = rows_of(corpus.config(root, source__images_dir="", source__captions_file=str(meta)),
                   tmp_path)
    assert col(rows, F.RAW_CAPTION) == [b"absolute"]


def test_missing_image_files(tmp_path):
    src = corpus.folder(tmp_path / "s", [("a.jpg", "ok"), ("gone.jpg", "missing"),
                                          ("subdir", "a directory"), ("", "no name")],
                        images={"a.jpg": corpus.jpeg()})
    (src / "images" / "subdir").mkdir()
    rows = rows_of(corpus.config(src), tmp_path)
    assert col(rows, F.KEY) == ["a.jpg#0", "gone.jpg#0", "subdir#0", inv("captions.csv:5")]
    assert col(rows, F.READ_ERROR) == [None, R.MISSING_FILE, R.MISSING_FILE, R.MISSING_FILE]
    assert [r[F.RAW_IMAGE.name] is None for r in rows] == [False, True, True, True]
    assert col(rows, F.RAW_CAPTION) == [b"ok", b"missing", b"a directory", b"no name"]


# --- folder + JSONL -------------------------------------------------------------------------------
def test_folder_jsonl_with_bad_lines(tmp_path):
    root = tmp_path / "s"
    (root / "images").mkdir(parents=True)
    (root / "images" / "a.jpg").write_bytes(corpus.jpeg(seed=1))
    (root / "images" / "b.jpg").write_bytes(corpus.jpeg(seed=2))
    corpus.write_jsonl(root / "captions.jsonl", [
        {"image": "a.jpg", "caption": "first", "score": 0.5},
        b"",                                  # blank lines are skipped, not records
        b'{"image": "b.jpg", "caption": ',    # unparsable
        b"[1, 2, 3]",                         # valid JSON, but not a record
        b"null",
        {"image": "b.jpg", "caption": "last", "score": 0.25},
        {"image": "b.jpg"},                   # no caption: the ingest stage rejects it
    ])
    rows = rows_of(corpus.config(root, source__extra_columns=["score"]), tmp_path)
    assert col(rows, F.KEY) == ["a.jpg#0", *(inv(f"captions.jsonl:{n}") for n in (3, 4, 5)),
                               "b.jpg#0", "b.jpg#1"]
    assert col(rows, F.READ_ERROR) == [None, R.BAD_RECORD, R.BAD_RECORD, R.BAD_RECORD, None, None]
    assert col(rows, F.RAW_CAPTION) == [b"first", None, None, None, b"last", None]
    assert json.loads(rows[0][F.EXTRA.name]) == {"score": "0.5"}
    errors = [json.loads(r[F.EXTRA.name])["error"] for r in rows[1:4]]
    assert errors[0].startswith("line 3: ")
    assert errors[1] == "line 4: expected a JSON object, got list"
    assert errors[2] == "line 5: expected a JSON object, got NoneType"
    out = build_stage(IngestStage, corpus.config(root))(readers.read_part(
        corpus.config(root).source, readers.plan(corpus.config(root).source, tmp_path / "p")[0]))
    assert out.column(F.REASONS.name).to_pylist() == [
        [], [R.BAD_RECORD, R.MISSING_CAPTION], [R.BAD_RECORD, R.MISSING_CAPTION],
        [R.BAD_RECORD, R.MISSING_CAPTION], [], [R.MISSING_CAPTION]]


def test_jsonl_record_without_an_image_key_is_a_bad_row_not_a_bad_source(tmp_path):
    src = corpus.folder(tmp_path / "s", [], images={"a.jpg": corpus.jpeg()})
    (src / "captions.csv").unlink()
    corpus.write_jsonl(src / "captions.jsonl", [{"caption": "no image key"},
                                                {"image": "a.jpg", "caption": "fine"}])
    rows = rows_of(corpus.config(src), tmp_path)
    assert col(rows, F.KEY) == [inv("captions.jsonl:1"), "a.jpg#0"]
    assert col(rows, F.READ_ERROR) == [R.MISSING_FILE, None]
    # ... but when no record has the configured key, the config is wrong: say so
    corpus.write_jsonl(src / "captions.jsonl", [{"image": "a.jpg", "text": "x"}, b"{broken"])
    with pytest.raises(SourceError, match=r"no column 'caption' \(source.caption_column\); "
                                          r"columns: \['image', 'text'\]"):
        readers.plan(corpus.config(src).source, tmp_path / "plan.parquet")


def test_max_captions_per_image_never_drops_rows_without_an_image_name(tmp_path):
    src = corpus.folder(tmp_path / "s", [("a.jpg", "one"), ("a.jpg", "two"), ("", "no image"),
                                          ("", "no image either")])
    rows = rows_of(corpus.config(src, source__max_captions_per_image=1), tmp_path)
    assert col(rows, F.KEY) == ["a.jpg#0", inv("captions.csv:4"), inv("captions.csv:5")]
    assert col(rows, F.READ_ERROR) == [None, R.MISSING_FILE, R.MISSING_FILE]


def test_metadata_jsonl_with_hf_imagefolder_columns(tmp_path):
    root = tmp_path / "hf"
    root.mkdir()
    (root / "0.png").write_bytes(corpus.png())
    corpus.write_jsonl(root / "metadata.jsonl", [{"file_name": "0.png", "text": "a png"}])
    cfg = corpus.config(root, source__images_dir="", source__image_column="file_name",
                        source__caption_column="text")
    rows = rows_of(cfg, tmp_path)
    assert col(rows, F.KEY) == ["0.png#0"] and col(rows, F.RAW_CAPTION) == [b"a png"]


# --- whole-source errors --------------------------------------------------------------------------
def test_missing_source_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SourceError, match="source.path does not exist") as e:
        readers.plan(corpus.config(missing).source, tmp_path / "plan.parquet")
    assert str(missing) in str(e.value)
    with pytest.raises(SourceError, match="source.path"):
        readers.plan(corpus.config("").source, tmp_path / "plan.parquet")


def test_missing_captions_file(tmp_path):
    (tmp_path / "s").mkdir()
    with pytest.raises(SourceError, match="captions.csv"):
        readers.plan(corpus.config(tmp_path / "s").source, tmp_path / "plan.parquet")
    with pytest.raises(SourceError, match="source.captions_file not found: .*other.csv"):
        readers.plan(corpus.config(tmp_path / "s", source__captions_file="other.csv").source,
                     tmp_path / "plan.parquet")


@pytest.mark.parametrize("setting,column", [("caption_column", "text"), ("image_column", "file")])
def test_missing_column_names_the_column(tmp_path, setting, column):
    src = corpus.folder(tmp_path / "s", [("a.jpg", "x")])
    cfg = corpus.config(src, **{f"source__{setting}": column})
    with pytest.raises(SourceError) as e:
        readers.plan(cfg.source, tmp_path / "plan.parquet")
    assert f"no column {column!r}" in str(e.value) and f"source.{setting}" in str(e.value)
    assert "captions.csv" in str(e.value)


def test_parquet_missing_column_names_the_column(tmp_path):
    pq.write_table(pa.table({"image": [b"x"], "text": ["t"]}), tmp_path / "d.parquet")
    cfg = corpus.config(tmp_path / "d.parquet", "parquet")
    with pytest.raises(SourceError, match="no column 'caption'"):  # before any part runs
        readers.plan(cfg.source, tmp_path / "plan.parquet")


def test_empty_img2dataset_folder(tmp_path):
    (tmp_path / "i2d").mkdir()
    with pytest.raises(SourceError, match="no img2dataset output"):
        readers.plan(corpus.config(tmp_path / "i2d", "img2dataset").source, tmp_path / "p")


# --- Parquet --------------------------------------------------------------------------------------
def test_parquet_with_image_bytes_and_row_groups(tmp_path):
    imgs = [corpus.jpeg(seed=i) for i in range(5)]
    imgs[3] = None
    t = pa.table({"image": pa.array(imgs, pa.binary()), "caption": [f"c{i}" for i in range(5)],
                  "license": ["a", "b", "c", "d", "e"], "id": [f"id{i}" for i in range(5)]})
    pq.write_table(t, tmp_path / "data.parquet", row_group_size=2)
    cfg = corpus.config(tmp_path / "data.parquet", "parquet", source__extra_columns=["license"])
    specs, parts = read_all(cfg, tmp_path)
    assert len(specs) == 3 and [p.num_rows for p in parts] == [2, 2, 1]
    rows = [r for p in parts for r in p.to_pylist()]
    # offsets run across row groups
    assert col(rows, F.KEY) == [inv(f"data.parquet:{i}") for i in range(5)]
    assert col(rows, F.IMAGE_REF) == [f"data.parquet:{i}" for i in range(5)]
    assert col(rows, F.RAW_IMAGE) == imgs
    assert col(rows, F.READ_ERROR) == [None, None, None, R.MISSING_IMAGE, None]
    assert col(rows, F.RAW_CAPTION) == [f"c{i}".encode() for i in range(5)]
    assert [json.loads(e) for e in col(rows, F.EXTRA)] == [{"license": x} for x in "abcde"]
    assert col(rows, F.SOURCE) == ["data.parquet"] * 5

    rows = rows_of(corpus.config(tmp_path / "data.parquet", "parquet", source__key_column="id"),
                   tmp_path)
    assert col(rows, F.KEY) == [f"id{i}" for i in range(5)]


def test_parquet_folder_with_several_files(tmp_path):
    root = tmp_path / "pq"
    root.mkdir()
    for n in ("b", "a"):
        pq.write_table(pa.table({"image": [corpus.jpeg()], "caption": [n]}), root / f"{n}.parquet")
    specs, parts = read_all(corpus.config(root, "parquet"), tmp_path)
    assert [Path(s["file"]).name for s in specs] == ["a.parquet", "b.parquet"]
    assert [p.column(F.KEY.name).to_pylist() for p in parts] == [[inv("a.parquet:0")],
                                                                   [inv("b.parquet:0")]]


def test_parquet_with_relative_and_absolute_image_paths(tmp_path):
    root = tmp_path / "pq"
    (root / "imgs").mkdir(parents=True)
    a, b = corpus.jpeg(seed=1), corpus.png()
    (root / "imgs" / "a.jpg").write_bytes(a)
    (tmp_path / "b.png").write_bytes(b)
    paths = ["imgs/a.jpg", str(tmp_path / "b.png"), "imgs/gone.jpg", None]
    pq.write_table(pa.table({"image": paths, "caption": ["a", "b", "gone", "null"]}),
                   root / "meta.parquet")
    rows = rows_of(corpus.config(root, "parquet"), tmp_path)   # b.png is outside the source
    assert col(rows, F.READ_ERROR) == [None, R.OUTSIDE_SOURCE, R.MISSING_FILE, R.MISSING_IMAGE]
    assert col(rows, F.RAW_IMAGE) == [a, None, None, None]
    rows = rows_of(corpus.config(root, "parquet", source__allow_outside_source=True), tmp_path)
    assert col(rows, F.RAW_IMAGE) == [a, b, None, None]
    assert col(rows, F.IMAGE_REF) == ["imgs/a.jpg", str(tmp_path / "b.png"), "imgs/gone.jpg",
                                      "meta.parquet:3"]
    assert col(rows, F.READ_ERROR) == [None, None, R.MISSING_FILE, R.MISSING_IMAGE]


def test_parquet_with_hugging_face_image_struct(tmp_path):
    root = tmp_path / "hf"
    root.mkdir()
    a, b = corpus.jpeg(seed=1), corpus.jpeg(seed=2)
    (root / "b.jpg").write_bytes(b)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    images = pa.array([{"bytes": a, "path": "a.jpg"}, {"bytes": None, "path": "b.jpg"},
                       {"bytes": None, "path": None}, None], image_type)
    pq.write_table(pa.table({"image": images, "caption": ["a", "b", "neither", "null"]}),
                   root / "train.parquet")
    rows = rows_of(corpus.config(root, "parquet"), tmp_path)
    assert col(rows, F.RAW_IMAGE) == [a, b, None, None]
    assert col(rows, F.IMAGE_REF) == ["a.jpg", "b.jpg", "train.parquet:2", "train.parquet:3"]
    assert col(rows, F.READ_ERROR) == [None, None, R.MISSING_IMAGE, R.MISSING_IMAGE]


# --- WebDataset -----------------------------------------------------------------------------------
def _wds_members() -> list[tuple[str, bytes]]:
    return [("0001.jpg", corpus.jpeg(seed=1)), ("0001.txt", b"a jpeg"),
            ("0001.json", b'{"url": "http://x/1", "similarity": 0.3}'),
            ("0002.png", corpus.png(seed=2)), ("0002.txt", b"a png"),
            ("0003.webp", corpus.webp(seed=3)), ("0003.txt", b"a webp"), ("0003.json", b"{}"),
            ("0004.txt", b"a caption and no image"), ("0004.json", b'{"status": "ok"}'),
            ("0005.jpg", corpus.jpeg(seed=5)), ("0005.json", b'{"caption": "caption in json"}'),
            ("0006.JPEG", corpus.jpeg(seed=6)), ("0006.TXT", b"upper-case extensions"),
            ("sub/0007.jpg", corpus.jpeg(seed=7)), ("sub/0007.txt", b"in a folder"),
            ("README", b"no extension: not a record")]


def test_webdataset_tar(tmp_path):
    members = dict(_wds_members())
    corpus.write_tar(tmp_path / "wds" / "shard-000000.tar", _wds_members())
    cfg = corpus.config(tmp_path / "wds", "webdataset")
    specs, parts = read_all(cfg, tmp_path)
    assert len(specs) == 1
    rows = corpus.by_key(parts[0])
    assert list(rows) == ["0001", "0002", "0003", "0004", "0005", "0006", "sub/0007"]
    r = rows["0001"]
    assert r[F.RAW_IMAGE.name] == members["0001.jpg"] and r[F.RAW_CAPTION.name] == b"a jpeg"
    assert r[F.IMAGE_REF.name] == "shard-000000.tar:0001.jpg"
    assert json.loads(r[F.EXTRA.name]) == {"url": "http://x/1", "similarity": 0.3}
    assert rows["0002"][F.RAW_IMAGE.name] == members["0002.png"]
    assert rows["0002"][F.EXTRA.name] is None
    assert rows["0003"][F.RAW_IMAGE.name] == members["0003.webp"]
    assert rows["0004"][F.READ_ERROR.name] == R.MISSING_IMAGE
    assert rows["0004"][F.RAW_IMAGE.name] is None
    assert rows["0004"][F.IMAGE_REF.name] == "shard-000000.tar:0004.?"
    assert rows["0005"][F.RAW_CAPTION.name] == b"caption in json"
    assert rows["0006"][F.RAW_IMAGE.name] == members["0006.JPEG"]
    assert rows["0006"][F.RAW_CAPTION.name] == b"upper-case extensions"
    assert rows["sub/0007"][F.RAW_CAPTION.name] == b"in a folder"
    assert [r[F.READ_ERROR.name] for k, r in rows.items() if k != "0004"] == [None] * 6

    out = corpus.by_key(build_stage(IngestStage, cfg)(parts[0]))
    assert {k: (r[F.IMAGE_FORMAT.name], r[F.IMAGE_REENCODED.name], r[F.REASONS.name])
            for k, r in out.items()} == {
        "0001": ("JPEG", False, []), "0002": ("PNG", True, []), "0003": ("WEBP", True, []),
        "0004": (None, None, [R.MISSING_IMAGE]), "0005": ("JPEG", False, []),
        "0006": ("JPEG", False, []), "sub/0007": ("JPEG", False, [])}
    assert out["0005"][F.CAPTION.name] == "caption in json"


def test_webdataset_one_part_per_tar(tmp_path):
    for n in (1, 0):
        corpus.write_tar(tmp_path / "wds" / f"{n:05d}.tar",
                         [(f"{n}.jpg", corpus.jpeg(seed=n)), (f"{n}.txt", b"x")])
    specs, parts = read_all(corpus.config(tmp_path / "wds", "webdataset"), tmp_path)
    assert [Path(s["file"]).name for s in specs] == ["00000.tar", "00001.tar"]
    assert [p.column(F.KEY.name).to_pylist() for p in parts] == [["0"], ["1"]]


def _cut_tar(tmp_path: Path, where: str) -> Path:
    members = [(f"000{i}.{ext}", corpus.jpeg(seed=i) if ext == "jpg" else f"caption {i}".encode())
               for i in (1, 2, 3) for ext in ("jpg", "txt")]
    full = corpus.write_tar(tmp_path / "full" / "x.tar", members)
    off = corpus.tar_offsets(full)
    data = full.read_bytes()
    cut = {"mid_data": data[:off["0002.jpg"][1] + 100],
           "at_header": data[:off["0002.txt"][0]],
           "mid_header": data[:off["0002.txt"][0] + 100],
           "no_end_block": data[:off["0003.txt"][1] + 512],
           "garbled_header": data[:off["0002.jpg"][0]] + b"garbage!" * 64
           + data[off["0002.jpg"][0] + 512:]}[where]
    out = tmp_path / "cut" / "x.tar"
    out.parent.mkdir()
    out.write_bytes(cut)
    return out.parent


@pytest.mark.parametrize("where,kept", [
    ("mid_data", ["0001"]),                 # inside a member's data: tarfile raises
    ("at_header", ["0001", "0002"]),        # at a block boundary: tarfile just stops
    ("mid_header", ["0001", "0002"]),
    ("no_end_block", ["0001", "0002", "0003"]),
    ("garbled_header", ["0001"]),
])
def test_truncated_or_corrupt_tar_keeps_what_was_read_plus_one_bad_record(tmp_path, where, kept):
    root = _cut_tar(tmp_path, where)
    cfg = corpus.config(root, "webdataset")
    _, parts = read_all(cfg, tmp_path)
    rows = parts[0].to_pylist()
    assert col(rows, F.KEY) == kept + [inv("x.tar:<unreadable>")]
    assert col(rows, F.READ_ERROR) == [None] * len(kept) + [R.BAD_RECORD]
    assert rows[0][F.RAW_CAPTION.name] == b"caption 1" and rows[0][F.RAW_IMAGE.name]
    assert json.loads(rows[-1][F.EXTRA.name])["error"].startswith(
        {"mid_data": "ReadError: unexpected end of data", "garbled_header": "invalid header at"}
        .get(where, "no end-of-archive block at offset"))
    out = build_stage(IngestStage, cfg)(parts[0])                        # and the stage takes it as it is
    assert out.num_rows == len(rows)
    assert out.column(F.REASONS.name).to_pylist()[0] == []
    assert out.column(F.REASONS.name).to_pylist()[-1] == [R.BAD_RECORD, R.MISSING_CAPTION]


@pytest.mark.parametrize("data", [b"", b"this is not a tar file at all" * 40])
def test_a_file_that_is_not_a_tar_is_one_bad_file_row(tmp_path, data):
    (tmp_path / "wds").mkdir()
    (tmp_path / "wds" / "bad.tar").write_bytes(data)
    rows = rows_of(corpus.config(tmp_path / "wds", "webdataset"), tmp_path)
    assert col(rows, F.KEY) == [inv("bad.tar:<unreadable>")]
    assert col(rows, F.READ_ERROR) == [R.BAD_FILE]


# --- img2dataset ----------------------------------------------------------------------------------
I2D_EXPECTED = {"000000000": (None, b"a downloaded cat"),
                "000000001": (R.DOWNLOAD_FAILED, b"a failed dog"),
                "000000002": (None, b"a downloaded bird"),
                "000000003": (R.DOWNLOAD_FAILED, b"a resized away fish")}


def _check_i2d(rows: dict[str, dict]) -> None:
    got = {k: (r[F.READ_ERROR.name], r[F.RAW_CAPTION.name]) for k, r in rows.items()}
    assert got == I2D_EXPECTED
    for key in ("000000000", "000000002"):
        assert rows[key][F.RAW_IMAGE.name] == corpus.jpeg(seed=100 + int(key))
    assert json.loads(rows["000000001"][F.EXTRA.name]) == {
        "error_message": "HTTP Error 404: Not Found"}
    assert json.loads(rows["000000003"][F.EXTRA.name])["error_message"] == "image too small"
    assert rows["000000001"][F.RAW_IMAGE.name] is None


def test_img2dataset_webdataset_layout(tmp_path):
    root = corpus.img2dataset_tars(tmp_path / "i2d")
    specs, parts = read_all(corpus.config(root, "img2dataset"), tmp_path)
    assert len(specs) == 1 and specs[0]["statuses"] is True
    rows = corpus.by_key(parts[0])
    _check_i2d(rows)
    assert rows["000000000"][F.IMAGE_REF.name] == "00000.tar:000000000.jpg"
    assert rows["000000001"][F.IMAGE_REF.name] == "http://example.com/000000001.jpg"
    assert json.loads(rows["000000000"][F.EXTRA.name])["status"] == "success"
    # read as a plain webdataset, the failures (which are only in the parquet) are not there
    rows = rows_of(corpus.config(root, "webdataset"), tmp_path)
    assert col(rows, F.KEY) == ["000000000", "000000002"]


def test_img2dataset_parquet_layout(tmp_path):
    root = corpus.img2dataset_parquet(tmp_path / "i2d")
    specs, parts = read_all(corpus.config(root, "img2dataset"), tmp_path)
    assert len(specs) == 1 and specs[0]["img2dataset"] is True
    rows = corpus.by_key(parts[0])
    assert list(rows) == list(I2D_EXPECTED)
    _check_i2d(rows)


def test_img2dataset_files_layout(tmp_path):
    root = corpus.img2dataset_files(tmp_path / "i2d")
    specs, parts = read_all(corpus.config(root, "img2dataset"), tmp_path)
    assert specs == [{"part": 0, "dir": str(root / "00000")}]
    rows = corpus.by_key(parts[0])
    _check_i2d(rows)
    assert rows["000000002"][F.IMAGE_REF.name] == "00000/000000002.jpg"


def test_img2dataset_layouts_give_the_same_sample_ids_and_reasons(tmp_path):
    results = {}
    for layout in ("tars", "parquet", "files"):
        root = getattr(corpus, f"img2dataset_{layout}")(tmp_path / layout)
        cfg = corpus.config(root, "img2dataset", source__name="i2d")
        _, parts = read_all(cfg, tmp_path)
        out = build_stage(IngestStage, cfg)(parts[0])
        assert out.num_rows == parts[0].num_rows == 4
        results[layout] = {r[F.SAMPLE_ID.name]: (r[F.REASONS.name], r[F.CAPTION.name])
                           for r in out.to_pylist()}
    assert results["tars"] == results["parquet"] == results["files"]
    assert sorted(map(tuple, (v[0] for v in results["tars"].values()))) == [
        (), (), (R.DOWNLOAD_FAILED,), (R.DOWNLOAD_FAILED,)]


# --- signature ------------------------------------------------------------------------------------
def test_signature_changes_when_the_captions_file_changes(tmp_path):
    src = corpus.folder(tmp_path / "s", [("a.jpg", "one")])
    cfg = corpus.config(src).source
    sig = readers.signature(cfg)
    assert sig == readers.signature(cfg) and len(sig) == 16
    corpus.write_csv(src / "captions.csv", ["image", "caption"],
                     [("a.jpg", "one"), ("a.jpg", "two")])
    sig2 = readers.signature(cfg)
    assert sig2 != sig
    # same size, new content: the mtime still tells
    path = src / "captions.csv"
    st = path.stat()
    path.write_bytes(path.read_bytes().replace(b"two", b"owt"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert path.stat().st_size == st.st_size
    assert readers.signature(cfg) not in (sig, sig2)


def test_signature_changes_when_a_shard_is_added(tmp_path):
    corpus.write_tar(tmp_path / "wds" / "00000.tar", [("0.jpg", corpus.jpeg()), ("0.txt", b"x")])
    cfg = corpus.config(tmp_path / "wds", "webdataset").source
    sig = readers.signature(cfg)
    corpus.write_tar(tmp_path / "wds" / "00001.tar", [("1.jpg", corpus.jpeg()), ("1.txt", b"y")])
    assert readers.signature(cfg) != sig
