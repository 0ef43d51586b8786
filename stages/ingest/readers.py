"""Source readers. ``plan`` splits a source into parts (the unit of work and of commit);
``read_part`` turns one part into raw records (:data:`schemas.tables.RAW_RECORDS`).

Readers only read bytes; they never decode images or captions (the ingest stage does, once).
What a reader already knows is wrong (a missing file, an unparsable line, a failed download)
goes into ``read_error`` so that the row is rejected, never skipped.
"""
from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Iterable, Optional

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import reasons as R

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
CAPTION_FILES = ("captions.csv", "captions.jsonl", "metadata.jsonl", "captions.tsv")


class SourceError(ValueError):
    """The source cannot be read at all (as opposed to a bad row, which becomes a reject)."""


def source_name(cfg: Any) -> str:
    return cfg.name or Path(cfg.path.rstrip("/")).name or "source"


def _files(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}") if p.is_file())


def _records(cfg: Any, rows: list[dict]) -> pa.Table:
    name = source_name(cfg)
    for r in rows:
        r.setdefault(F.SOURCE.name, name)
    return conform(pa.Table.from_pylist(rows, schema=tables.RAW_RECORDS), tables.RAW_RECORDS)


def _extra(values: dict) -> Optional[str]:
    return json.dumps(values, ensure_ascii=False, default=str, sort_keys=True) if values else None


# --- a folder of images with a captions CSV/TSV/JSONL -------------------------------------------
def _captions_path(cfg: Any) -> Path:
    root = Path(cfg.path)
    if cfg.captions_file:
        p = Path(cfg.captions_file)
        p = p if p.is_absolute() else root / p
        if not p.exists():
            raise SourceError(f"source.captions_file not found: {p}")
        return p
    for n in CAPTION_FILES:
        if (root / n).exists():
            return root / n
    raise SourceError(f"no captions file in {root}: expected one of {', '.join(CAPTION_FILES)} "
                      "or set source.captions_file")


def _read_jsonl(path: Path) -> Iterable[tuple[dict, Optional[str]]]:
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.decode("utf-8", "surrogateescape"))
            except json.JSONDecodeError as e:
                yield {"__line__": n}, f"line {n}: {e}"
                continue
            if not isinstance(obj, dict):  # valid JSON, not a record: a bad row, not a bad source
                yield {"__line__": n}, f"line {n}: expected a JSON object, got {type(obj).__name__}"
                continue
            yield obj, None


def _read_csv(path: Path, cfg: Any) -> Iterable[tuple[dict, Optional[str]]]:
    delim = "\t" if path.suffix == ".tsv" else ","
    with open(path, "rb") as fh:
        header = fh.readline().decode("utf-8", "replace").lstrip("\ufeff").strip("\r\n").split(delim)
    header = [h.strip().strip('"') for h in header]
    table = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(delimiter=delim,
                                                                  newlines_in_values=True),
                           convert_options=pacsv.ConvertOptions(
                               column_types={h: pa.binary() for h in header}))
    for row in table.to_pylist():
        yield {k.lstrip("\ufeff"): v for k, v in row.items()}, None


def _text(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


def _raw_caption(v: Any) -> Optional[bytes]:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v
    return str(v).encode("utf-8", "surrogateescape")


def _plan_folder(cfg: Any, plan_path: Path) -> list[dict]:
    path = _captions_path(cfg)
    rows = _read_jsonl(path) if path.suffix == ".jsonl" else _read_csv(path, cfg)
    out, seen, columns, n_records = [], {}, set(), 0
    for i, (row, error) in enumerate(rows):
        if error is None:  # a JSONL record may lack a key (a bad row): columns are checked below
            columns.update(row)
            n_records += 1
        image = _text(row.get(cfg.image_column)) or ""
        n = seen[image] = seen.get(image, -1) + 1
        # the cap is per image; rows with no image name (bad lines, empty cells) are never capped
        if image and cfg.max_captions_per_image is not None and n >= cfg.max_captions_per_image:
            continue
        if cfg.key_column:
            key = _text(row.get(cfg.key_column))
        else:
            key = f"{image}#{n}" if image else f"row{i}"
        out.append({F.KEY.name: key or f"row{i}", F.IMAGE_REF.name: image,
                    F.RAW_CAPTION.name: _raw_caption(row.get(cfg.caption_column)),
                    F.EXTRA.name: _extra({c: _text(row.get(c)) for c in cfg.extra_columns}),
                    F.READ_ERROR.name: R.BAD_RECORD if error else (None if image else R.MISSING_FILE),
                    "error_detail": error})
    for setting in ("image_column", "caption_column"):  # no record at all has it: a config error
        column = getattr(cfg, setting)
        if n_records and column not in columns:
            raise SourceError(f"{path}: no column {column!r} (source.{setting}); "
                              f"columns: {sorted(columns)}")
    schema = pa.schema([F.KEY, F.IMAGE_REF, F.RAW_CAPTION, F.EXTRA, F.READ_ERROR,
                        pa.field("error_detail", pa.string())])
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(out, schema=schema), plan_path,
                   row_group_size=cfg.rows_per_part)
    n_parts = pq.ParquetFile(plan_path).num_row_groups if out else 0
    return [{"part": i, "plan": str(plan_path), "row_group": i} for i in range(n_parts)]


def _read_folder(cfg: Any, spec: dict) -> pa.Table:
    rows = pq.ParquetFile(spec["plan"]).read_row_group(spec["row_group"]).to_pylist()
    root = Path(cfg.path) / cfg.images_dir
    for r in rows:
        detail = r.pop("error_detail", None)
        if detail:  # say what was wrong with the line (as a corrupt tar's row does)
            r[F.EXTRA.name] = _extra({"error": detail})
        if r[F.READ_ERROR.name] is None:
            p = root / r[F.IMAGE_REF.name]
            try:
                r[F.RAW_IMAGE.name] = p.read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                r[F.READ_ERROR.name] = R.MISSING_FILE
            except OSError:
                r[F.READ_ERROR.name] = R.MISSING_FILE
    return _records(cfg, rows)


# --- Parquet with image bytes or paths (also img2dataset's parquet output) ------------------------
def _plan_parquet(cfg: Any) -> list[dict]:
    root = Path(cfg.path)
    files = [root] if root.is_file() else _files(root, ".parquet")
    specs = []
    for f in files:
        meta = pq.ParquetFile(f).metadata
        offset = 0
        for g in range(meta.num_row_groups):
            specs.append({"file": str(f), "row_group": g, "offset": offset})
            offset += meta.row_group(g).num_rows
    return [dict(s, part=i) for i, s in enumerate(specs)]


def _image_cell(v: Any, base: Path) -> tuple[Optional[bytes], Optional[str], Optional[str]]:
    """(bytes, image_ref, read_error) for a bytes, path or {bytes, path} struct cell."""
    if isinstance(v, dict):  # Hugging Face datasets' Image feature
        if v.get("bytes") is not None:
            return v["bytes"], v.get("path"), None
        v = v.get("path")
    if isinstance(v, (bytes, bytearray)):
        return bytes(v), None, None
    if isinstance(v, str) and v:
        p = Path(v) if Path(v).is_absolute() else base / v
        try:
            return p.read_bytes(), v, None
        except OSError:
            return None, v, R.MISSING_FILE
    return None, None, R.MISSING_IMAGE


def _read_parquet(cfg: Any, spec: dict, status_column: Optional[str] = None) -> pa.Table:
    f = Path(spec["file"])
    t = pq.ParquetFile(f).read_row_group(spec["row_group"])
    image_column, key_column = cfg.image_column, cfg.key_column
    if status_column:  # img2dataset: bytes in a column named after its encode format, ids in "key"
        if image_column not in t.column_names:  # (the same keys as its tar and files layouts)
            image_column = next((c for c in IMAGE_EXTS if c in t.column_names), image_column)
        if key_column is None and "key" in t.column_names:
            key_column = "key"
    for col in (image_column, cfg.caption_column):
        if col not in t.column_names:
            raise SourceError(f"{f}: no column {col!r}; columns: {t.column_names}")
    rows = []
    for i, r in enumerate(t.to_pylist()):
        key = _text(r.get(key_column)) if key_column else None
        data, ref, err = _image_cell(r.get(image_column), f.parent)
        if status_column and r.get(status_column) not in (None, "success"):
            err = R.DOWNLOAD_FAILED
        extra = {c: r.get(c) for c in cfg.extra_columns}
        if err == R.DOWNLOAD_FAILED and r.get("error_message"):
            extra["error_message"] = r["error_message"]
        rows.append({F.KEY.name: key or f"{f.stem}:{spec['offset'] + i}",
                     F.IMAGE_REF.name: ref or f"{f.name}:{spec['offset'] + i}",
                     F.RAW_IMAGE.name: data, F.RAW_CAPTION.name: _raw_caption(r.get(cfg.caption_column)),
                     F.EXTRA.name: _extra(extra), F.READ_ERROR.name: err})
    return _records(cfg, rows)


# --- WebDataset tars (and img2dataset's webdataset / files output) --------------------------------
def _split_key(name: str) -> tuple[str, str]:
    """WebDataset convention: the key is the path up to the first dot of the basename."""
    d, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


def _group_members(members: Iterable[tuple[str, bytes]]) -> list[tuple[str, dict[str, bytes]]]:
    groups: dict[str, dict[str, bytes]] = {}
    for name, data in members:
        key, ext = _split_key(name)
        if ext:
            groups.setdefault(key, {})[ext] = data
    return list(groups.items())


def _record_from_group(key: str, fields: dict[str, bytes], ref_prefix: str) -> dict:
    ext = next((e for e in IMAGE_EXTS if e in fields), None)
    meta: dict = {}
    if "json" in fields:
        try:
            meta = json.loads(fields["json"])
        except (ValueError, UnicodeDecodeError):
            meta = {}
    caption = fields.get("txt")
    if caption is None and isinstance(meta, dict) and isinstance(meta.get("caption"), str):
        caption = meta["caption"].encode("utf-8", "surrogateescape")
    return {F.KEY.name: key, F.IMAGE_REF.name: f"{ref_prefix}{key}.{ext or '?'}",
            F.RAW_IMAGE.name: fields.get(ext) if ext else None, F.RAW_CAPTION.name: caption,
            F.EXTRA.name: fields["json"].decode("utf-8", "replace") if "json" in fields else None,
            F.READ_ERROR.name: None if ext else R.MISSING_IMAGE}


def _tar_members(path: Path, errors: list[str]) -> Iterable[tuple[str, bytes]]:
    try:
        with tarfile.open(path, "r:*") as tf:
            for m in tf:
                if m.isfile():
                    fh = tf.extractfile(m)
                    yield m.name, fh.read() if fh else b""
            # tarfile ends the loop without an error at a header that is cut short, missing or
            # garbled after the first member; a complete archive has its zero end block there.
            tf.fileobj.seek(tf.offset)
            if tf.fileobj.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
                errors.append(f"ReadError: no end-of-archive block at offset {tf.offset} "
                              "(truncated or corrupt)")
    except (tarfile.TarError, EOFError, OSError) as e:
        errors.append(f"{type(e).__name__}: {e}")


def _failed_downloads(parquet: Path) -> list[dict]:
    """img2dataset writes every attempted row, failures included, to a parquet beside the tar."""
    if not parquet.exists():
        return []
    t = pq.read_table(parquet)
    if "status" not in t.column_names:
        return []
    rows = []
    for r in t.to_pylist():
        if r.get("status") != "success":
            rows.append({F.KEY.name: str(r.get("key")), F.IMAGE_REF.name: str(r.get("url")),
                         F.RAW_CAPTION.name: _raw_caption(r.get("caption")),
                         F.EXTRA.name: _extra({"error_message": r.get("error_message")}),
                         F.READ_ERROR.name: R.DOWNLOAD_FAILED})
    return rows


def _read_tar(cfg: Any, spec: dict) -> pa.Table:
    path = Path(spec["file"])
    errors: list[str] = []
    rows = [_record_from_group(k, v, f"{path.name}:") for k, v in
            _group_members(_tar_members(path, errors))]
    if errors:  # a truncated or corrupt tar: keep what was read, and say what was not
        rows.append({F.KEY.name: f"{path.name}:<unreadable>", F.IMAGE_REF.name: path.name,
                     F.EXTRA.name: _extra({"error": errors[0]}), F.READ_ERROR.name: R.BAD_RECORD})
    if spec.get("statuses"):
        rows.extend(_failed_downloads(path.with_suffix(".parquet")))
    return _records(cfg, rows)


def _read_files_dir(cfg: Any, spec: dict) -> pa.Table:
    d = Path(spec["dir"])
    members = ((p.name, p.read_bytes()) for p in sorted(d.iterdir()) if p.is_file()
               and not p.name.endswith((".parquet", "_stats.json")))
    rows = [_record_from_group(k, v, f"{d.name}/") for k, v in _group_members(members)]
    rows.extend(_failed_downloads(d.with_suffix(".parquet")))
    return _records(cfg, rows)


# --- dispatch -------------------------------------------------------------------------------------
def _img2dataset_layout(root: Path) -> str:
    if _files(root, ".tar"):
        return "tar"
    if any(p.is_dir() and any(q.suffix.lstrip(".").lower() in IMAGE_EXTS for q in p.iterdir())
           for p in root.iterdir()):
        return "files"
    if _files(root, ".parquet"):
        return "parquet"
    raise SourceError(f"{root}: no img2dataset output found (no .tar shards, image folders or "
                      ".parquet files)")


def _root(cfg: Any) -> Path:
    root = Path(cfg.path)
    if not cfg.path or not root.exists():
        raise SourceError(f"source.path does not exist: {cfg.path!r}")
    return root


def plan(cfg: Any, plan_path: str | Path) -> list[dict]:
    """The parts of the source, each a JSON-able dict with a ``part`` index."""
    root = _root(cfg)
    if cfg.kind == "folder":
        return _plan_folder(cfg, Path(plan_path))
    if cfg.kind == "parquet":
        return _plan_parquet(cfg)
    layout = "tar" if cfg.kind == "webdataset" else _img2dataset_layout(root)
    if layout == "tar":
        return [{"part": i, "file": str(f), "statuses": cfg.kind == "img2dataset"}
                for i, f in enumerate(_files(root, ".tar"))]
    if layout == "files":
        dirs = sorted(p for p in root.iterdir() if p.is_dir())
        return [{"part": i, "dir": str(d)} for i, d in enumerate(dirs)]
    return [dict(s, img2dataset=True) for s in _plan_parquet(cfg)]


def read_part(cfg: Any, spec: dict) -> pa.Table:
    if cfg.kind == "folder":
        return _read_folder(cfg, spec)
    if "dir" in spec:
        return _read_files_dir(cfg, spec)
    if spec.get("file", "").endswith(".tar"):
        return _read_tar(cfg, spec)
    return _read_parquet(cfg, spec, "status" if spec.get("img2dataset") else None)


def signature(cfg: Any) -> str:
    """A cheap fingerprint of the source's content: names, sizes and mtimes of its index files."""
    root = _root(cfg)
    if cfg.kind == "folder":
        files = [_captions_path(cfg)]
    elif root.is_file():
        files = [root]
    else:  # shards and metadata files; a files-layout folder changes its own mtime
        files = [p for p in sorted(root.rglob("*")) if p.suffix in (".tar", ".parquet")
                 or (p.is_dir() and p.parent == root)]
    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root) if p != root else p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


__all__ = ["plan", "read_part", "signature", "source_name", "SourceError"]

