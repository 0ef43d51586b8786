"""Test inputs for the ingest stage and its readers, generated into a tmp dir (no data files).

Image builders return bytes; source builders write a whole source (a folder with a captions
file, Parquet, WebDataset tars, the three img2dataset layouts) and return its root. Everything
is tiny and deterministic (seeded), so the whole ingest suite runs in a few seconds.
"""
from __future__ import annotations

import io
import json
import random
import struct
import tarfile
import zlib
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vlcurate.pipeline import config as C
from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import reasons as R

RED, BLUE, WHITE = (220, 30, 30), (30, 60, 220), (255, 255, 255)


# --- config --------------------------------------------------------------------------------------
def config(path: Path | str, kind: str = "folder", **overrides: Any) -> C.Config:
    """A full config for a source at ``path``; ``overrides`` use ``__`` for the dot:
    ``config(p, source__key_column="id", ingest__max_pixels=100)``."""
    dotted = {"source.path": str(path), "source.kind": kind}
    for k, v in overrides.items():
        dotted[k.replace("__", ".")] = list(v) if isinstance(v, tuple) else v
    return C.load(None, dotted)


# --- images --------------------------------------------------------------------------------------
def noise_image(w: int = 64, h: int = 48, seed: int = 0) -> Image.Image:
    """Smooth-ish RGB content (a JPEG of pure noise is large and slow for no benefit)."""
    y, x = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    a = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)),
                  rng.integers(0, 256, (h, w))], axis=-1).astype(np.uint8)
    return Image.fromarray(a, "RGB")


def halves(w: int, h: int, left: tuple, right: tuple, mode: str = "RGB") -> Image.Image:
    """Left half one colour, right half another."""
    im = Image.new(mode, (w, h), left)
    im.paste(Image.new(mode, (w - w // 2, h), right), (w // 2, 0))
    return im


def encode(im: Image.Image, fmt: str = "JPEG", **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def jpeg(w: int = 64, h: int = 48, *, seed: int = 0, quality: int = 90,
         exif_orientation: Optional[int] = None) -> bytes:
    kw: dict = {"quality": quality}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kw["exif"] = exif.tobytes()
    return encode(noise_image(w, h, seed), "JPEG", **kw)


def png(w: int = 64, h: int = 48, seed: int = 0) -> bytes:
    return encode(noise_image(w, h, seed), "PNG")


def webp(w: int = 64, h: int = 48, seed: int = 0) -> bytes:
    return encode(noise_image(w, h, seed), "WEBP", quality=90)


def cmyk_jpeg(w: int = 32, h: int = 32) -> bytes:
    """Pure red in CMYK (0, 255, 255, 0)."""
    return encode(Image.new("CMYK", (w, h), (0, 255, 255, 0)), "JPEG", quality=95)


GREY16_LEVELS = (0, 32768, 65535)


def grey16_png(w: int = 48, h: int = 16) -> bytes:
    """16-bit greyscale (PIL mode I;16): three vertical bands at 0, 32768 and 65535."""
    a = np.zeros((h, w), np.uint16)
    for i, level in enumerate(GREY16_LEVELS):
        a[:, i * w // 3:(i + 1) * w // 3] = level
    im = Image.fromarray(a)
    assert im.mode == "I;16", im.mode
    return encode(im, "PNG")


def rgba_png(w: int = 32, h: int = 16) -> bytes:
    """Left half fully transparent (black underneath), right half opaque blue."""
    return encode(halves(w, h, (0, 0, 0, 0), (*BLUE, 255), "RGBA"), "PNG")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(w: int, h: int) -> bytes:
    """A PNG whose IHDR declares ``w`` x ``h`` RGB but whose pixel data is a few bytes: only a
    reader that trusts the header before allocating the pixels survives it."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", zlib.compress(b"\0" * 16)) + _png_chunk(b"IEND", b""))


def truncated_jpeg() -> bytes:
    """The first third of a real JPEG."""
    data = jpeg(seed=1)
    return data[: len(data) // 3]


def corrupt_jpeg(seed: int = 0) -> bytes:
    """Valid JPEG headers (SOI..SOS), then random bytes where the entropy-coded data was."""
    data = jpeg(seed=2)
    start = data.index(b"\xff\xda")
    sos_len = struct.unpack(">H", data[start + 2:start + 4])[0]
    body = start + 2 + sos_len
    rng = random.Random(seed)
    noise = bytes(rng.randrange(256) for _ in range(len(data) - body - 2))
    return data[:body] + noise + b"\xff\xd9"


def garbage_after_header(seed: int = 0) -> bytes:
    """A JPEG's SOI + JFIF APP0 segment, then random bytes (no frame header at all)."""
    rng = random.Random(seed)
    return jpeg(seed=3)[:20] + bytes(rng.randrange(256) for _ in range(400))


# --- captions files -------------------------------------------------------------------------------
def csv_field(value: bytes | str) -> bytes:
    """CSV-quote raw bytes (they may be invalid UTF-8 or hold newlines on purpose)."""
    if isinstance(value, str):
        value = value.encode("utf-8")
    return b'"' + value.replace(b'"', b'""') + b'"'


def write_csv(path: Path, header: Iterable[str], rows: Iterable[Iterable[bytes | str]],
              delimiter: bytes = b",", bom: bool = False) -> Path:
    """Write a CSV in binary, so that any byte sequence can be a cell."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(b"\xef\xbb\xbf" if bom else b"")
        fh.write(delimiter.join(h.encode() for h in header) + b"\n")
        for row in rows:
            fh.write(delimiter.join(csv_field(v) for v in row) + b"\n")
    return path


def write_jsonl(path: Path, lines: Iterable[dict | bytes]) -> Path:
    """One JSON object per line; a ``bytes`` item is written verbatim (for broken lines)."""
    with open(path, "wb") as fh:
        for line in lines:
            fh.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            fh.write(b"\n")
    return path


# --- the bad-input corpus -------------------------------------------------------------------------
# (key, image file, caption bytes, expected reasons). Image files not in BAD_IMAGES do not exist.
def bad_images() -> dict[str, bytes]:
    return {"good.jpg": jpeg(seed=10), "good2.jpg": jpeg(seed=11),
            "corrupt.jpg": corrupt_jpeg(), "garbage.jpg": garbage_after_header(),
            "truncated.jpg": truncated_jpeg(), "zero.jpg": b"",
            "not_image.jpg": b"<html>404 not found</html>",
            "cmyk.jpg": cmyk_jpeg(), "grey16.png": grey16_png(), "rgba.png": rgba_png(),
            "huge.png": png_header(30000, 30000), "tiny.png": png(4, 4)}


LONG_CAPTION = "a" * 10_000
BAD_ROWS: list[tuple[str, str, bytes, list[str]]] = [
    ("good", "good.jpg", b"a good photo", []),
    ("corrupt", "corrupt.jpg", b"a corrupt jpeg", [R.UNDECODABLE]),
    ("garbage", "garbage.jpg", b"a header then noise", [R.UNDECODABLE]),
    ("truncated", "truncated.jpg", b"a truncated jpeg", [R.TRUNCATED]),
    ("zero", "zero.jpg", b"a zero byte file", [R.ZERO_BYTE]),
    ("not_image", "not_image.jpg", b"an html page", [R.UNDECODABLE]),
    ("cmyk", "cmyk.jpg", b"a cmyk jpeg", []),
    ("grey16", "grey16.png", b"a 16-bit png", []),
    ("rgba", "rgba.png", b"a transparent png", []),
    ("huge", "huge.png", b"a decompression bomb", [R.TOO_LARGE]),
    ("tiny", "tiny.png", b"a 4x4 png", [R.TOO_SMALL]),
    ("missing", "missing.jpg", b"no such file", [R.MISSING_FILE]),
    ("no_image_name", "", b"an empty image cell", [R.MISSING_FILE]),
    ("empty_caption", "good2.jpg", b"", [R.EMPTY_CAPTION]),
    ("blank_caption", "good2.jpg", " \t\r\n\u00a0\u3000 ".encode(), [R.EMPTY_CAPTION]),
    ("latin1_caption", "good2.jpg", "caf\u00e9".encode("latin-1"), [R.NON_UTF8]),
    ("long_caption", "good2.jpg", LONG_CAPTION.encode(), [R.CAPTION_TOO_LONG]),
    # two problems at once: the image reason comes first
    ("truncated_latin1", "truncated.jpg", b"\xff\xfe", [R.TRUNCATED, R.NON_UTF8]),
    ("missing_empty", "missing.jpg", b"   ", [R.MISSING_FILE, R.EMPTY_CAPTION]),
    # the same key twice: ingest keeps both (same sample_id); the ids stage flags the second
    ("dup", "good.jpg", b"the first dup", []),
    ("dup", "good2.jpg", b"the second dup", []),
]


def bad_corpus(root: Path) -> Path:
    """``root/images/*`` + ``root/captions.csv`` (columns key, image, caption) of BAD_ROWS."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    for name, data in bad_images().items():
        (root / "images" / name).write_bytes(data)
    write_csv(root / "captions.csv", ["key", "image", "caption"],
              [(k, img, cap) for k, img, cap, _ in BAD_ROWS])
    return root


def folder(root: Path, rows: list[tuple[str, bytes | str]], *, images: Optional[dict] = None,
           header: tuple[str, str] = ("image", "caption")) -> Path:
    """A folder source: images (default: a distinct JPEG per image name) and captions.csv."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    if images is None:
        images = {name: jpeg(seed=i) for i, name in enumerate(dict.fromkeys(r[0] for r in rows))
                  if name}
    for name, data in images.items():
        (root / "images" / name).write_bytes(data)
    write_csv(root / "captions.csv", header, rows)
    return root


# --- raw records (the stage's input, built directly) ---------------------------------------------
def raw_records(rows: list[dict], source: str = "src") -> pa.Table:
    """RAW_RECORDS rows from dicts with short names: key, image, caption, ref, extra, error."""
    names = {"key": F.KEY, "image": F.RAW_IMAGE, "caption": F.RAW_CAPTION, "ref": F.IMAGE_REF,
             "extra": F.EXTRA, "error": F.READ_ERROR, "source": F.SOURCE}
    out = []
    for i, r in enumerate(rows):
        d = {F.SOURCE.name: source, F.KEY.name: f"k{i}", F.IMAGE_REF.name: f"ref{i}"}
        for k, v in r.items():
            d[names[k].name] = v.encode() if k == "caption" and isinstance(v, str) else v
        out.append(d)
    return conform(pa.Table.from_pylist(out, schema=tables.RAW_RECORDS), tables.RAW_RECORDS)


# --- WebDataset / img2dataset ---------------------------------------------------------------------
def write_tar(path: Path, members: Iterable[tuple[str, bytes]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return path


def tar_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """member name -> (header offset, data offset) in an uncompressed tar."""
    with tarfile.open(path, "r:") as tf:
        return {m.name: (m.offset, m.offset_data) for m in tf.getmembers()}


I2D_STATUS_SCHEMA = pa.schema([("key", pa.string()), ("url", pa.string()), ("caption", pa.string()),
                               ("status", pa.string()), ("error_message", pa.string())])

# key, caption, status (None = downloaded) for one img2dataset shard "00000"
I2D_ROWS = [("000000000", "a downloaded cat", None),
            ("000000001", "a failed dog", "failed_to_download"),
            ("000000002", "a downloaded bird", None),
            ("000000003", "a resized away fish", "failed_to_resize")]
I2D_ERRORS = {"failed_to_download": "HTTP Error 404: Not Found",
              "failed_to_resize": "image too small"}


def _i2d_status_table(with_images: bool) -> pa.Table:
    rows = []
    for i, (key, caption, status) in enumerate(I2D_ROWS):
        r = {"key": key, "url": f"http://example.com/{key}.jpg", "caption": caption,
             "status": status or "success", "error_message": I2D_ERRORS.get(status)}
        if with_images:
            r["jpg"] = None if status else jpeg(seed=100 + i)
        rows.append(r)
    schema = I2D_STATUS_SCHEMA
    if with_images:
        schema = schema.append(pa.field("jpg", pa.binary()))
    return pa.Table.from_pylist(rows, schema=schema)


def _i2d_members() -> list[tuple[str, bytes]]:
    out = []
    for i, (key, caption, status) in enumerate(I2D_ROWS):
        if status is None:
            out += [(f"{key}.jpg", jpeg(seed=100 + i)), (f"{key}.txt", caption.encode()),
                    (f"{key}.json", json.dumps({"key": key, "caption": caption,
                                                "status": "success"}).encode())]
    return out


def _i2d_stats(root: Path) -> None:
    (root / "00000_stats.json").write_text(json.dumps({"count": len(I2D_ROWS), "successes": 2}))


def img2dataset_tars(root: Path) -> Path:
    """output_format=webdataset: 00000.tar (successes only) + 00000.parquet (every row)."""
    root.mkdir(parents=True, exist_ok=True)
    write_tar(root / "00000.tar", _i2d_members())
    pq.write_table(_i2d_status_table(False), root / "00000.parquet")
    _i2d_stats(root)
    return root


def img2dataset_parquet(root: Path) -> Path:
    """output_format=parquet: 00000.parquet with the image bytes in a `jpg` column + status."""
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(_i2d_status_table(True), root / "00000.parquet")
    _i2d_stats(root)
    return root


def img2dataset_files(root: Path) -> Path:
    """output_format=files: 00000/000000000.jpg/.txt/.json + 00000.parquet (every row)."""
    (root / "00000").mkdir(parents=True, exist_ok=True)
    for name, data in _i2d_members():
        (root / "00000" / name).write_bytes(data)
    pq.write_table(_i2d_status_table(False), root / "00000.parquet")
    _i2d_stats(root)
    return root


# --- helpers for assertions ---------------------------------------------------------------------
def by_key(table: pa.Table) -> dict[str, dict]:
    """key -> row (keys must be unique)."""
    rows = table.to_pylist()
    out = {r[F.KEY.name]: r for r in rows}
    assert len(out) == len(rows), "duplicate keys; use to_pylist()"
    return out


def decode_rgb(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im
