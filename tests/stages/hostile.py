"""A hostile-input corpus for the ingest readers, generated into a tmp dir, in every source format.

A record is a dict: ``key``, ``image`` (bytes; ``None`` = no image file/member), optional
``name`` (the image's file name in a folder source, bytes or str), ``caption`` (bytes, or any
JSON value for the JSON-carrying formats), optional ``special`` ("fifo", "symlink:<target>",
"hardlink", "sparse", "device") and ``expect`` (the reasons the ingest stage must give).
:func:`write` renders records as one source of a format; format-specific damage (ragged CSV
lines, a truncated tar, a junk Parquet file) is added by the case builders in the test module.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from . import corpus

FORMATS = ("csv", "tsv", "jsonl", "parquet", "webdataset", "img2dataset")
FOLDER = ("csv", "tsv", "jsonl")
TARS = ("webdataset", "img2dataset")
KIND = {"csv": "folder", "tsv": "folder", "jsonl": "folder", "parquet": "parquet",
        "webdataset": "webdataset", "img2dataset": "img2dataset"}


def good(key: str, seed: int = 0, caption: Any = b"a good photo") -> dict:
    return {"key": key, "image": corpus.jpeg(32, 24, seed=seed), "caption": caption, "expect": []}


def _b(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogatepass")


# --- folder: images/ + captions.{csv,tsv,jsonl} ------------------------------------------------
def _image_files(root: Path, recs: list[dict]) -> None:
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    for r in recs:
        name = r.get("name", f"{r['key']}.jpg")
        if isinstance(name, str) and ("\0" in name or name.startswith(("/", ".."))):
            continue  # (such a name is a test of the path, not a file to write)
        p = os.path.join(os.fsencode(images), os.fsencode(name) if isinstance(name, str) else name)
        special = r.get("special", "")
        if special == "fifo":
            os.mkfifo(p)
        elif special.startswith("symlink:"):
            os.symlink(special.split(":", 1)[1], p)
        elif r.get("image") is not None:
            with open(p, "wb") as fh:
                fh.write(r["image"])


def _folder_table(root: Path, recs: list[dict], fmt: str, lines: Iterable[bytes] = ()) -> None:
    delim = b"\t" if fmt == "tsv" else b","
    with open(root / f"captions.{fmt}", "wb") as fh:
        fh.write(delim.join([b"key", b"image", b"caption"]) + b"\n")
        for r in recs:
            name = r.get("name", f"{r['key']}.jpg")
            cells = [_b(r["key"]), _b(name) if isinstance(name, str) else name, _b(r["caption"])]
            fh.write(delim.join(corpus.csv_field(c) for c in cells) + b"\n")
        for line in lines:
            fh.write(line)


def _folder_jsonl(root: Path, recs: list[dict], lines: Iterable[bytes] = ()) -> None:
    with open(root / "captions.jsonl", "wb") as fh:
        for r in recs:
            if "line" in r:      # a hand-written line (JSON escapes the json module won't write)
                fh.write(r["line"] + b"\n")
                continue
            name = r.get("name", f"{r['key']}.jpg")
            name = name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
            cap = r["caption"]
            cap = cap.decode("utf-8", "surrogateescape") if isinstance(cap, bytes) else cap
            key = r["key"]
            fh.write(json.dumps({"key": key, "image": name, "caption": cap}).encode() + b"\n")
        for line in lines:
            fh.write(line)


# --- parquet: key, image bytes (or path), caption -------------------------------------------------
def _parquet(root: Path, recs: list[dict], name: str = "data.parquet") -> None:
    root.mkdir(parents=True, exist_ok=True)
    caps = [r["caption"] for r in recs]
    cap_type = pa.binary() if all(c is None or isinstance(c, bytes) for c in caps) else None
    paths = any("path" in r for r in recs)
    t = pa.table({"key": pa.array([_b(r["key"]) for r in recs], pa.binary()),
                  "image": pa.array([r.get("path") if paths else r.get("image") for r in recs],
                                    pa.string() if paths else pa.binary()),
                  "caption": pa.array(caps, cap_type)})
    pq.write_table(t, root / name)


# --- tars: key.jpg + key.txt (or key.json) -----------------------------------------------------
def tar_members(recs: list[dict]) -> list[tuple[Any, bytes, str]]:
    """(name, data, special) in order; a record's caption goes to .txt, a non-bytes caption to
    .json as {"caption": ...}."""
    out = []
    for r in recs:
        key = r["key"]
        name = (key if isinstance(key, bytes) else key.encode("utf-8", "surrogateescape")) + b".jpg"
        if r.get("image") is not None or r.get("special"):
            out.append((name, r.get("image") or b"", r.get("special", "")))
        cap = r["caption"]
        if isinstance(cap, bytes):
            out.append((name[:-4] + b".txt", cap, ""))
        elif cap is not None:
            out.append((name[:-4] + b".json", json.dumps({"caption": cap}).encode(), ""))
    return out


def write_tar(path: Path, members: list[tuple[Any, bytes, str]], mode: str = "w") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, mode, format=tarfile.GNU_FORMAT, encoding="utf-8",
                      errors="surrogateescape") as tf:
        for name, data, special in members:
            info = tarfile.TarInfo(os.fsdecode(name) if isinstance(name, bytes) else name)
            info.mtime = 1_700_000_000
            if special.startswith("symlink:"):
                info.type, info.linkname = tarfile.SYMTYPE, special.split(":", 1)[1]
            elif special == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, "other.jpg"
            elif special == "fifo":
                info.type = tarfile.FIFOTYPE
            elif special == "device":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 5
            elif special == "sparse":
                info.type, info.size = tarfile.GNUTYPE_SPARSE, len(data)
            else:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if info.isreg() or special == "sparse" else None)
    return path


def i2d_status(root: Path, keys: list[str], name: str = "00000.parquet") -> None:
    pq.write_table(pa.table({"key": keys, "url": [f"http://x/{k}" for k in keys],
                             "caption": ["c"] * len(keys), "status": ["success"] * len(keys),
                             "error_message": pa.array([None] * len(keys), pa.string())}),
                   root / name)


def write(fmt: str, root: Path, recs: list[dict], *, extra_lines: Iterable[bytes] = ()) -> Path:
    """Render ``recs`` as a source of format ``fmt`` at ``root``; returns the source path."""
    root.mkdir(parents=True, exist_ok=True)
    if fmt in FOLDER:
        _image_files(root, recs)
        if fmt == "jsonl":
            _folder_jsonl(root, recs, extra_lines)
        else:
            _folder_table(root, recs, fmt, extra_lines)
    elif fmt == "parquet":
        _parquet(root, recs)
    else:
        write_tar(root / "00000.tar", tar_members(recs))
        if fmt == "img2dataset":
            i2d_status(root, [])   # every row downloaded: the status file lists no failures
    return root


def config(fmt: str, root: Path, **overrides: Any):
    if fmt in FOLDER or fmt == "parquet":
        overrides.setdefault("source__key_column", "key")
    if fmt in FOLDER:
        overrides.setdefault("source__captions_file", f"captions.{fmt}")
    return corpus.config(root, KIND[fmt], **overrides)
