"""The ingest stage end to end without Ray: raw records -> the samples table, rejects included."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pyarrow as pa
import pytest

from . import corpus
from vlcurate.pipeline.runner import build_stage
from vlcurate.schemas import F, tables
from vlcurate.schemas import reasons as R
from vlcurate.stages.ids import IdsStage, find_duplicates
from vlcurate.stages.ingest import IngestStage, captions, readers, sample_id


def ingest(cfg, tmp_path) -> tuple[list[pa.Table], list[pa.Table]]:
    """(raw parts, ingest outputs) for the source in ``cfg``."""
    specs = readers.plan(cfg.source, tmp_path / "plan.parquet")
    stage = build_stage(IngestStage, cfg)
    raw = [readers.read_part(cfg.source, s) for s in specs]
    return raw, [stage(t) for t in raw]


# --- the bad-input corpus -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    src = corpus.bad_corpus(tmp / "bad_src")
    cfg = corpus.config(src, source__key_column="key")
    raw, out = ingest(cfg, tmp)
    assert len(out) == 1
    return raw[0], out[0]


def test_bad_corpus_rows_in_equal_rows_out_and_schema(bad):
    raw, out = bad
    assert raw.num_rows == out.num_rows == len(corpus.BAD_ROWS)
    assert out.schema == tables.SAMPLES
    assert out.column(F.KEY.name).to_pylist() == [k for k, *_ in corpus.BAD_ROWS]
    assert set(out.column(F.SOURCE.name).to_pylist()) == {"bad_src"}


def test_bad_corpus_every_row_has_its_reasons(bad):
    _, out = bad
    got = list(zip(out.column(F.KEY.name).to_pylist(), out.column(F.REASONS.name).to_pylist()))
    assert got == [(k, want) for k, _, _, want in corpus.BAD_ROWS]
    for r in out.to_pylist():
        if r[F.REASONS.name]:
            assert all(x in R.INGEST for x in r[F.REASONS.name])
            if r[F.KEY.name] != "no_image_name":     # nothing to name: the image cell was empty
                assert r[F.REASON_DETAIL.name], r[F.KEY.name]
        else:
            assert r[F.REASON_DETAIL.name] is None


def test_bad_corpus_image_rejects_have_no_image(bad):
    _, out = bad
    image_reasons = {R.UNDECODABLE, R.TRUNCATED, R.ZERO_BYTE, R.TOO_LARGE, R.TOO_SMALL,
                     R.MISSING_FILE}
    for r in out.to_pylist():
        rejected_image = bool(image_reasons & set(r[F.REASONS.name]))
        for f in (F.IMAGE, F.WIDTH, F.HEIGHT, F.IMAGE_FORMAT, F.IMAGE_MODE, F.IMAGE_REENCODED):
            assert (r[f.name] is None) == rejected_image, (r[F.KEY.name], f.name)


def test_bad_corpus_details(bad):
    _, out = bad
    rows = {r[F.KEY.name]: r for r in out.to_pylist()}
    assert rows["huge"][F.REASON_DETAIL.name].startswith("900000000 pixels > max_pixels")
    assert rows["tiny"][F.REASON_DETAIL.name] == "4x4: a side is below min_side 8"
    assert rows["truncated"][F.REASON_DETAIL.name].startswith("OSError: image file is truncated")
    assert rows["missing"][F.REASON_DETAIL.name] == "missing.jpg: no such file"
    assert rows["latin1_caption"][F.REASON_DETAIL.name] == "byte 3 (0xe9) is not UTF-8"
    assert rows["long_caption"][F.REASON_DETAIL.name] == "10000 characters > max_caption_chars 2048"
    # two reasons: two details, in the same order
    assert rows["missing_empty"][F.REASON_DETAIL.name] == (
        "missing.jpg: no such file; caption is empty after whitespace normalisation")


def test_bad_corpus_captions(bad):
    _, out = bad
    rows = {r[F.KEY.name]: r for r in out.to_pylist()}
    for key in ("empty_caption", "blank_caption", "latin1_caption", "missing_empty"):
        assert rows[key][F.CAPTION.name] is None, key
    # too long is flagged, but the (normalised) text is kept for whoever inspects the reject
    assert rows["long_caption"][F.CAPTION.name] == corpus.LONG_CAPTION
    assert rows["good"][F.CAPTION.name] == "a good photo"
    assert rows["missing"][F.CAPTION.name] == "no such file"    # image reject keeps its caption


def test_bad_corpus_good_rows_are_normalised_to_rgb(bad):
    _, out = bad
    rows = {r[F.KEY.name]: r for r in out.to_pylist()}
    expect = {"good": (64, 48, "JPEG", "RGB", False), "cmyk": (32, 32, "JPEG", "CMYK", True),
              "grey16": (48, 16, "PNG", "I;16", True), "rgba": (32, 16, "PNG", "RGBA", True)}
    for key, (w, h, fmt, mode, reencoded) in expect.items():
        r = rows[key]
        assert (r[F.WIDTH.name], r[F.HEIGHT.name], r[F.IMAGE_FORMAT.name], r[F.IMAGE_MODE.name],
                r[F.IMAGE_REENCODED.name]) == (w, h, fmt, mode, reencoded), key
        im = corpus.decode_rgb(r[F.IMAGE.name])
        assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (w, h)), key
    assert rows["good"][F.IMAGE.name] == corpus.bad_images()["good.jpg"]   # passthrough

    def px(key):
        return np.asarray(corpus.decode_rgb(rows[key][F.IMAGE.name])).astype(int)
    assert np.abs(px("cmyk")[16, 16] - (255, 0, 0)).max() <= 8
    grey = px("grey16")[8]
    assert np.abs(grey[8] - 0).max() <= 3
    assert np.abs(grey[24] - 128).max() <= 3        # 32768 -> ~128, not clipped to 255
    assert np.abs(grey[40] - 255).max() <= 3        # 65535 -> 255
    rgba = px("rgba")
    assert rgba[8, 4].min() >= 250                  # transparent -> white
    assert np.abs(rgba[8, 28] - corpus.BLUE).max() <= 12


def test_bad_corpus_duplicate_keys_are_flagged_by_the_ids_stage(tmp_path):
    src = corpus.bad_corpus(tmp_path / "bad_src")
    # 4 rows per part: the two "dup" rows (the last two) land in different parts
    cfg = corpus.config(src, source__key_column="key", source__rows_per_part=4)
    _, outs = ingest(cfg, tmp_path)
    assert sum(t.num_rows for t in outs) == len(corpus.BAD_ROWS)
    assert [t.num_rows for t in outs][-2:] == [4, 1]

    def read(part):
        t = outs[part]
        return t.append_column(F.ROW.name, pa.array(np.arange(t.num_rows, dtype=np.int64)))

    dups = find_duplicates(read, len(outs))
    # the first "dup" is row 19 of 21 (part 4, row 3); the second is part 5 row 0
    assert dups == {5: {0: "same sample_id as part 4 row 3"}}
    dup_ids = [r[F.SAMPLE_ID.name] for t in outs for r in t.to_pylist() if r[F.KEY.name] == "dup"]
    assert len(dup_ids) == 2 and dup_ids[0] == dup_ids[1]
    # and the ids stage turns that into reasons, row for row
    t = read(5).append_column(F.PART.name, pa.array([5], pa.int64()))
    flagged = build_stage(IdsStage, cfg, state=dups)(
        t.select([F.SAMPLE_ID.name, F.IMAGE_HASH.name, F.PART.name, F.ROW.name]))
    assert flagged.column(F.REASONS.name).to_pylist() == [[R.DUPLICATE_ID]]


def test_find_duplicates_keeps_the_first_and_flags_every_later_one():
    parts = [["a", "b", "a"], ["c", "b"], ["a"]]

    def read(p):
        return pa.table({F.SAMPLE_ID.name: parts[p],
                         F.ROW.name: pa.array(range(len(parts[p])), pa.int64())})

    assert find_duplicates(read, 3) == {
        0: {2: "same sample_id as part 0 row 0"},
        1: {1: "same sample_id as part 0 row 1"},
        2: {0: "same sample_id as part 0 row 0"}}
    assert find_duplicates(lambda p: read(1), 1) == {}


# --- the stage on raw records ---------------------------------------------------------------------
def test_read_error_wins_over_the_bytes():
    t = corpus.raw_records([{"image": corpus.jpeg(), "caption": "fine", "error": R.DOWNLOAD_FAILED,
                             "ref": "http://x/1.jpg"}])
    r = build_stage(IngestStage, corpus.config("/nowhere"))(t).to_pylist()[0]
    assert r[F.REASONS.name] == [R.DOWNLOAD_FAILED]
    assert r[F.REASON_DETAIL.name] == "http://x/1.jpg"
    assert r[F.IMAGE.name] is None and r[F.WIDTH.name] is None
    assert r[F.CAPTION.name] == "fine"


def test_missing_image_and_caption_in_a_record():
    t = corpus.raw_records([{"image": None, "caption": None}])
    r = build_stage(IngestStage, corpus.config("/nowhere"))(t).to_pylist()[0]
    assert r[F.REASONS.name] == [R.MISSING_IMAGE, R.MISSING_CAPTION]


def test_passthrough_fields_and_exif_rotation():
    plain, rotated = corpus.jpeg(64, 48), corpus.jpeg(64, 48, exif_orientation=6)
    png = corpus.png(64, 48)
    t = corpus.raw_records([{"image": plain, "caption": "plain", "extra": '{"a": 1}',
                             "ref": "p.jpg"},
                            {"image": rotated, "caption": "rotated"},
                            {"image": png, "caption": "png"}], source="web")
    rows = build_stage(IngestStage, corpus.config("/nowhere"))(t).to_pylist()
    assert [r[F.REASONS.name] for r in rows] == [[], [], []]
    assert rows[0][F.IMAGE.name] == plain and rows[0][F.IMAGE_REENCODED.name] is False
    assert (rows[0][F.EXTRA.name], rows[0][F.IMAGE_REF.name], rows[0][F.SOURCE.name]) == (
        '{"a": 1}', "p.jpg", "web")
    assert rows[1][F.IMAGE_REENCODED.name] is True and rows[1][F.IMAGE.name] != rotated
    assert (rows[1][F.WIDTH.name], rows[1][F.HEIGHT.name]) == (48, 64)
    assert corpus.decode_rgb(rows[1][F.IMAGE.name]).size == (48, 64)
    assert rows[2][F.IMAGE_REENCODED.name] is True and rows[2][F.IMAGE_FORMAT.name] == "PNG"
    assert corpus.decode_rgb(rows[2][F.IMAGE.name]).format == "JPEG"


def test_ingest_config_reaches_the_decoder():
    t = corpus.raw_records([{"image": corpus.jpeg(64, 48), "caption": "x" * 20}])
    out = build_stage(IngestStage, corpus.config("/nowhere", ingest__max_pixels=1000))(t).to_pylist()[0]
    assert out[F.REASONS.name] == [R.TOO_LARGE]
    out = build_stage(IngestStage, corpus.config("/nowhere", ingest__min_side=50))(t).to_pylist()[0]
    assert out[F.REASONS.name] == [R.TOO_SMALL]
    out = build_stage(IngestStage, corpus.config("/nowhere", ingest__reencode="always"))(t).to_pylist()[0]
    assert out[F.REASONS.name] == [] and out[F.IMAGE_REENCODED.name] is True
    out = build_stage(IngestStage, corpus.config("/nowhere", ingest__max_caption_chars=19))(t).to_pylist()[0]
    assert out[F.REASONS.name] == [R.CAPTION_TOO_LONG]


def test_empty_batch():
    out = build_stage(IngestStage, corpus.config("/nowhere"))(corpus.raw_records([]))
    assert out.num_rows == 0 and out.schema == tables.SAMPLES


# --- captions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,want", [
    ("e\u0301t\u0065\u0301", "\u00e9t\u00e9"),                 # NFD -> NFC
    ("caf\u00e9", "caf\u00e9"),                                # already NFC: unchanged
    ("a\tb\nc\r\nd", "a b c d"),
    ("a\u00a0b\u2003c\u3000d", "a b c d"),                     # NBSP, em space, ideographic space
    ("  many     spaces  ", "many spaces"),
    ("bell\x07null\x00esc\x1b[0mdel\x7f!", "bell null esc [0mdel !"),   # controls -> one space
    ("a \x00 b", "a b"),
    ("\ufeffwith a BOM", "with a BOM"),
    ("mid\ufeffdle", "middle"),
    ("\u2028line\u2029sep\x85", "line sep"),
])
def test_caption_normalisation(raw, want):
    assert captions.normalise(raw) == want
    caption, reason, _ = captions.decode(raw.encode("utf-8"), max_chars=2048)
    assert (caption, reason) == (want, None)


def test_caption_normalisation_through_the_stage():
    raws = [b"\xef\xbb\xbf  e\xcc\x81t\xc3\xa9\t\tin\r\nParis\xc2\xa0 ", b"\x00\x07\t",
            b"\xed\xa0\x80"]
    out = build_stage(IngestStage, corpus.config("/nowhere"))(
        corpus.raw_records([{"image": corpus.jpeg(), "caption": c} for c in raws])).to_pylist()
    assert [r[F.CAPTION.name] for r in out] == ["\u00e9t\u00e9 in Paris", None, None]
    # only controls -> empty; an encoded surrogate is not valid UTF-8
    assert [r[F.REASONS.name] for r in out] == [[], [R.EMPTY_CAPTION], [R.NON_UTF8]]


def test_caption_length_is_counted_after_normalisation():
    assert captions.decode(b"  " + b"x" * 2048 + b"\n", max_chars=2048)[1] is None
    assert captions.decode(b"x" * 2049, max_chars=2048)[1] == R.CAPTION_TOO_LONG
    assert captions.decode(" ".join(["ab"] * 683).encode(), max_chars=2048)[1] is None  # 2048 chars
    assert captions.decode(b"\xc3\xa9" * 2048, max_chars=2048)[1] is None  # chars, not bytes
    assert captions.decode(None, max_chars=10) == (None, R.MISSING_CAPTION,
                                                   "no caption in the record")


# --- sample ids -----------------------------------------------------------------------------------
def test_sample_id_is_a_stable_function_of_source_and_key():
    assert sample_id("src", "a.jpg#0") == "10e165ed55e95c79"        # pinned: ids survive releases
    assert sample_id("laion", "000000001") == "efd305579a343136"
    assert sample_id("src", "k") == hashlib.blake2b(b"src\0k", digest_size=8).hexdigest()
    assert sample_id("src", "k") == sample_id("src", "k")
    assert sample_id("src", "k") != sample_id("other", "k")
    assert sample_id("src", "k") != sample_id("src", "k2")
    assert sample_id("ab", "c") != sample_id("a", "bc")              # the separator matters
    assert sample_id("src", "bad\udcff") != sample_id("src", "bad")  # surrogate-escaped keys work


def test_sample_ids_do_not_depend_on_row_order_or_content():
    recs = [{"key": f"k{i}", "image": corpus.jpeg(seed=i), "caption": f"caption {i}"}
            for i in range(6)]
    stage = build_stage(IngestStage, corpus.config("/nowhere"))

    def ids(rows, source="src"):
        out = stage(corpus.raw_records(rows, source=source))
        return dict(zip(out.column(F.KEY.name).to_pylist(),
                        out.column(F.SAMPLE_ID.name).to_pylist()))

    first = ids(recs)
    assert len(set(first.values())) == 6 and all(len(v) == 16 for v in first.values())
    shuffled = recs[:]
    random.Random(0).shuffle(shuffled)
    assert ids(shuffled) == first
    assert ids([dict(r, caption="changed", image=b"") for r in recs]) == first
    other = ids(recs, source="other")
    assert set(other) == set(first) and not set(other.values()) & set(first.values())


def test_sample_ids_from_a_folder_do_not_depend_on_parts(tmp_path):
    src = corpus.folder(tmp_path / "photos", [(f"{i}.jpg", f"c{i}") for i in range(5)])

    def ids(**kw):
        _, outs = ingest(corpus.config(src, **kw), tmp_path)
        return [i for t in outs for i in t.column(F.SAMPLE_ID.name).to_pylist()]

    base = ids()
    assert base == ids(source__rows_per_part=2) == ids()
    assert base[0] == sample_id("photos", "0.jpg#0")
    assert ids(source__name="renamed")[0] == sample_id("renamed", "0.jpg#0") != base[0]


def test_image_hash_is_equal_for_equal_bytes_only():
    from vlcurate.stages.base import once_per_image
    from vlcurate.stages.ingest.stage import image_hash
    assert image_hash(b"abc") == image_hash(b"abc") != image_hash(b"abd")
    assert len(image_hash(b"abc")) == 32
    calls: list[list[bytes]] = []
    out = once_per_image([b"x", b"y", b"x"], lambda ims: calls.append(ims) or [i.upper() for i in ims])
    assert out == [b"X", b"Y", b"X"] and calls == [[b"x", b"y"]]
