"""Source readers. ``plan`` splits a source into parts (the unit of work and of commit);
``read_part`` turns one part into raw records (:data:`schemas.tables.RAW_RECORDS`).

The contract: every record a source holds becomes exactly one raw record, and one that cannot
be read carries a ``read_error`` reason (the row is rejected, never skipped); nothing a source
holds makes ``read_part`` raise. A source file that is not what its name says is one
``ingest.bad_file`` row. ``plan`` raises :class:`SourceError` (before any part runs) only for
the source as a whole: no records, the wrong kind for its files, a column the config names
that is not there. Readers only read bytes (bounded by ``source.max_image_bytes``, never from a
FIFO, device or socket); they never decode images or captions (the ingest stage does, once).
A row's ``extra`` JSON says what was wrong (``{"error": ...}``) when the reader knows.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.foundation import storage
from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import reasons as R

from . import keys, safe, tars, textfiles
from .objpath import ObjPath, forget_listings, src_path
from .safe import clean_text

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
CAPTION_FILES = ("captions.csv", "captions.jsonl", "metadata.jsonl", "captions.tsv")
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_PLAN_SCHEMA = pa.schema([F.KEY, F.IMAGE_REF, F.RAW_CAPTION, F.EXTRA, F.READ_ERROR,
                          F.PLAN_IMAGE_PATH, F.PLAN_ERROR])


class SourceError(ValueError):
    """The source cannot be read at all (as opposed to a bad row, which becomes a reject).
    Always one line (a file name may hold a newline): the CLI prints it as ``error: ...``."""

    def __str__(self) -> str:
        return clean_text(super().__str__()).replace("\r", "\\r").replace("\n", "\\n")


def source_name(cfg: Any) -> str:
    return cfg.name or Path(cfg.path.rstrip("/")).name or "source"


def _files(root: Path | ObjPath, suffixes: tuple[str, ...]) -> list[Path]:
    """Every entry under ``root`` named ``*<suffix>`` that is not a directory (FIFOs and other
    special files included: they become reject rows, never silently missing)."""
    if not root.is_dir():
        return [root] if root.name.endswith(suffixes) else []
    if isinstance(root, ObjPath):            # the source's one LIST
        return [p for p in root.walk_files() if p.name.endswith(suffixes)]
    out = []
    for d, dirs, names in os.walk(root):
        dirs.sort()
        out += [Path(d) / n for n in names if n.endswith(suffixes)]
    return sorted(out)


def _records(cfg: Any, rows: list[dict]) -> pa.Table:
    name = source_name(cfg)
    for r in rows:
        r.setdefault(F.SOURCE.name, name)
        for f in (F.SOURCE, F.KEY, F.IMAGE_REF, F.EXTRA):
            r[f.name] = clean_text(r.get(f.name))
    return conform(pa.Table.from_pylist(rows, schema=tables.RAW_RECORDS), tables.RAW_RECORDS)


def _extra(values: dict) -> Optional[str]:
    return json.dumps(values, ensure_ascii=False, default=str, sort_keys=True) if values else None


def _reject(key: str, ref: str, reason: str, error: str) -> dict:
    return {F.KEY.name: key, F.IMAGE_REF.name: ref, F.READ_ERROR.name: reason,
            F.EXTRA.name: _extra({F.EXTRA_ERROR_KEY: error})}


def _text(v: Any) -> Optional[str]:
    if v is None:
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    return v if isinstance(v, str) else json.dumps(v, default=str)


def caption_bytes(v: Any) -> tuple[Optional[bytes], bool]:
    """(raw caption, ok). A string keeps its exact bytes (a lone surrogate stays invalid
    UTF-8, so the stage rejects it as non-UTF-8); a list, object, number or bool is not ok."""
    if v is None or isinstance(v, bytes):
        return v, True
    if isinstance(v, str):
        return v.encode("utf-8", "surrogatepass"), True
    return None, False


def _with_error(extra: Optional[str], error: str) -> str:
    """``extra`` with {"error": ...} added (what the reader knows is wrong with the row)."""
    try:
        d = json.loads(extra) if extra else {}
    except ValueError:
        d = {}
    d = d if isinstance(d, dict) else {}
    d[F.EXTRA_ERROR_KEY] = error
    return _extra(d)


# --- a folder of images with a captions CSV/TSV/JSONL -------------------------------------------
def captions_path(cfg: Any) -> Path | ObjPath:
    root = src_path(cfg.path)
    if cfg.captions_file:
        p = src_path(cfg.captions_file, cfg.path)
        p = p if p.is_absolute() else root / cfg.captions_file
        if not p.exists():
            raise SourceError(f"source.captions_file not found: {p}")
        return p
    for n in CAPTION_FILES:
        if (root / n).exists():
            return root / n
    raise SourceError(f"no captions file in {root}: expected one of {', '.join(CAPTION_FILES)} "
                      f"or set source.captions_file{_hint(root, 'folder')}")


def _image_name(v: Any) -> tuple[str, Optional[bytes], Optional[str], str]:
    """(image name as text, path bytes, read_error, detail) of an image cell."""
    if v is None or v in (b"", ""):
        return "", None, R.MISSING_FILE, "no image name in the record"
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape"), v, None, ""
    if not isinstance(v, str):
        return "", None, R.BAD_RECORD, f"image name is a {type(v).__name__}, not a string"
    try:
        return v, os.fsencode(v), None, ""
    except UnicodeError:
        return v, None, R.MISSING_FILE, "image name is not a valid file name"


def _folder_row(cfg: Any, row: Optional[dict], error: Optional[str], where: str, n: int) -> dict:
    """A plan row. A bad line (``error``) keeps its key when its key cell could be read."""
    row = row or {}
    image, path, err, detail = _image_name(row.get(cfg.image_column)) if error is None \
        else ("", None, R.BAD_RECORD, error)
    caption, ok = caption_bytes(row.get(cfg.caption_column)) if error is None else (None, True)
    if not ok and err is None:
        err, detail = R.BAD_CAPTION, f"caption is a {type(row[cfg.caption_column]).__name__}"
    key = _text(row.get(cfg.key_column)) if cfg.key_column else (f"{image}#{n}" if image else None)
    return {F.KEY.name: keys.real(key) or keys.invent(where), F.IMAGE_REF.name: image,
            F.RAW_CAPTION.name: caption,
            F.EXTRA.name: _extra({c: _text(row.get(c)) for c in cfg.extra_columns}),
            F.READ_ERROR.name: err, F.PLAN_IMAGE_PATH.name: path, F.PLAN_ERROR.name: detail or None}


def _folder_rows(cfg: Any, path: Path) -> tuple[list[dict], Optional[list[str]]]:
    """Plan rows of a captions file, and the columns its records have (None: no record)."""
    out, seen, columns, header = [], {}, set(), []
    with safe.open_regular(path) as fh:
        rows = textfiles.read_jsonl(fh) if path.suffix == ".jsonl" else \
            textfiles.read_table(fh, b"\t" if path.suffix == ".tsv" else b",", header)
        for row, error, line in rows:
            if row is not None and error is None:  # (a bad line's row: the cells it could read)
                columns.update(row)
            image = _text((row or {}).get(cfg.image_column)) or "" if error is None else ""
            n = seen[image] = seen.get(image, -1) + 1
            # the cap is per image; rows with no image name (bad lines, empty cells): never capped
            if image and cfg.max_captions_per_image is not None and n >= cfg.max_captions_per_image:
                continue
            out.append(_folder_row(cfg, row, error, f"{path.name}:{line}", n))
    if path.suffix != ".jsonl":
        return out, sorted(header)
    return out, sorted(columns) if columns else None


def _plan_folder(cfg: Any, plan_uri: str) -> list[dict]:
    path = captions_path(cfg)
    try:
        out, columns = _folder_rows(cfg, path)
    except OSError as e:
        raise SourceError(f"cannot read the captions file: {safe.detail(e)}") from None
    if not out:
        raise SourceError(f"{path}: no records (an empty captions file)")
    for setting in ("image_column", "caption_column", "key_column"):  # no record has it: an error
        column = getattr(cfg, setting)
        if column and columns is not None and column not in columns:
            raise SourceError(f"{path}: no column {column!r} (source.{setting}); "
                              f"columns: {columns}")
    for r in out:
        for k in (F.KEY.name, F.IMAGE_REF.name, F.EXTRA.name, F.PLAN_ERROR.name):
            r[k] = clean_text(r[k])
    buf = pa.BufferOutputStream()       # the plan beside the run's tables (maybe in a bucket)
    pq.write_table(pa.Table.from_pylist(out, schema=_PLAN_SCHEMA), buf,
                   row_group_size=cfg.rows_per_part)
    storage.write_bytes(str(plan_uri), buf.getvalue().to_pybytes())
    n_parts = -(-len(out) // cfg.rows_per_part)
    return [{"part": i, "plan": str(plan_uri), "row_group": i} for i in range(n_parts)]


def _read_folder(cfg: Any, spec: dict) -> pa.Table:
    fs, path = storage.resolve(spec["plan"])
    with fs.open_input_file(path) as fh:
        rows = pq.ParquetFile(fh).read_row_group(spec["row_group"]).to_pylist()
    root = src_path(cfg.path)
    base = root / cfg.images_dir
    wanted = [r[F.PLAN_IMAGE_PATH.name] if r[F.READ_ERROR.name] in (None, R.BAD_CAPTION) else None
              for r in rows]
    images = _fetch(wanted, lambda p: safe.read_member(
        base, p, root, limit=cfg.max_image_bytes, allow_outside=cfg.allow_outside_source),
        remote=isinstance(root, ObjPath))
    for r, got in zip(rows, images):
        path, error = r.pop(F.PLAN_IMAGE_PATH.name), r.pop(F.PLAN_ERROR.name)
        if got is not None:
            data, reason, detail = got
            r[F.RAW_IMAGE.name] = data
            if reason:  # an unreadable image wins over a bad caption (one read_error per row)
                r[F.READ_ERROR.name], error = reason, detail
        if error:  # say what was wrong with the line (as a corrupt tar's row does)
            r[F.EXTRA.name] = _with_error(r[F.EXTRA.name], error)
    return _records(cfg, rows)


REMOTE_READS = 16    # images fetched at once from an object store (a GET each: latency-bound)


def _fetch(paths: list, read: Any, remote: bool) -> list:
    """``read(p)`` for each path (None stays None), in order; from an object store
    REMOTE_READS at a time (the results are the same, only the waiting overlaps)."""
    if not remote:
        return [None if p is None else read(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(REMOTE_READS) as pool:
        return list(pool.map(lambda p: None if p is None else read(p), paths))


# --- Parquet with image bytes or paths (also img2dataset's parquet output) ------------------------
def _caption_ok(cfg: Any, f: Path, t: pa.DataType) -> None:
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) \
            or pa.types.is_large_binary(t) or pa.types.is_null(t):
        return
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and cfg.caption_list == "first":
        return
    fix = "; set source.caption_list: first to take the first element of each list" \
        if pa.types.is_list(t) or pa.types.is_large_list(t) else ""
    raise SourceError(f"{f}: caption column {cfg.caption_column!r} is {t}, not a string{fix}")


def _parquet_columns(cfg: Any, f: Path, schema: pa.Schema, i2d: bool) -> dict:
    names = schema.names
    image, key = cfg.image_column, cfg.key_column
    if i2d:  # img2dataset: bytes in a column named after its encode format, ids in "key"
        if image not in names:
            image = next((c for c in IMAGE_EXTS if c in names), image)
        if key is None and "key" in names:
            key = "key"
    for col, setting in ((image, "image_column"), (cfg.caption_column, "caption_column"),
                         (cfg.key_column, "key_column")):
        if col and col not in names:   # a configured key column must exist: never row-index keys
            raise SourceError(f"{f}: no column {col!r} (source.{setting}); columns: {names}")
    _caption_ok(cfg, f, schema.field(cfg.caption_column).type)
    extra = [c for c in cfg.extra_columns if c in names]
    status = [c for c in ("status", "error_message") if i2d and c in names]
    return {"image": image, "key": key if key in names else None,
            "columns": sorted({image, cfg.caption_column, *extra, *status,
                               *([key] if key in names else [])})}


def _plan_parquet(cfg: Any, i2d: bool = False) -> list[dict]:
    root = src_path(cfg.path)
    files = _files(root, (".parquet",))
    if not files:
        raise SourceError(f"no .parquet files in {root}{_hint(root, 'parquet')}")
    specs, n_rows = [], 0
    for f in files:
        try:
            with safe.open_regular(f) as fh:
                pf = pq.ParquetFile(fh)
                meta, schema = pf.metadata, pf.schema_arrow
                disk = safe.size_of(fh)
                cols, offset = _parquet_columns(cfg, f, schema, i2d), 0
        except SourceError:
            raise
        except Exception as e:  # not a Parquet file (or a FIFO named .parquet): one reject row
            reason = R.SPECIAL_FILE if isinstance(e, safe.NotRegular) else R.BAD_FILE
            specs.append({"file": str(f), "bad_file": safe.detail(e), "reason": reason})
            continue
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            specs.append(dict(cols, file=str(f), row_group=g, offset=offset, rows=rg.num_rows,
                              declared=_declared_bytes(rg), disk=disk,
                              img2dataset=i2d))
            offset += rg.num_rows
        n_rows += meta.num_rows
    if not n_rows and not any("bad_file" in s for s in specs):
        raise SourceError(f"{root}: no records (every .parquet file is empty)")
    return [dict(s, part=i) for i, s in enumerate(specs)]


def _declared_bytes(rg: Any) -> int:
    """What the row group says its columns take once decompressed. (Row-group level only: a
    hostile column-chunk entry can make pyarrow abort the process when it is parsed.)"""
    return max(int(rg.total_byte_size), 0)


def _image_cell(v: Any, base: Path,
                cfg: Any) -> tuple[Optional[bytes], Optional[str], Optional[str], str]:
    """(bytes, image_ref, read_error, detail) for a bytes, path or {bytes, path} struct cell."""
    if isinstance(v, dict):  # Hugging Face datasets' Image feature
        if v.get("bytes") is not None:
            data, _, err, detail = _image_cell(v["bytes"], base, cfg)
            return data, _text(v.get("path")), err, detail
        v = v.get("path")
    if isinstance(v, (bytes, bytearray)):
        if len(v) > cfg.max_image_bytes:
            return None, None, R.FILE_TOO_LARGE, f"{len(v)} bytes > max_image_bytes"
        return bytes(v), None, None, ""
    if isinstance(v, str) and v:
        source = src_path(cfg.path)
        root = source if source.is_dir() else source.parent
        data, reason, detail = safe.read_member(base, v, root, limit=cfg.max_image_bytes,
                                                allow_outside=cfg.allow_outside_source)
        return data, v, reason, detail
    return None, None, R.MISSING_IMAGE, ""


def _parquet_rows(cfg: Any, spec: dict) -> Iterable[dict]:
    with safe.open_regular(src_path(spec["file"], cfg.path)) as fh:
        pf = pq.ParquetFile(fh)
        for batch in pf.iter_batches(batch_size=64, row_groups=[spec["row_group"]],
                                     columns=spec["columns"]):
            yield from batch.to_pylist()


def _parquet_record(cfg: Any, spec: dict, f: Path, i: int, r: dict) -> dict:
    key = _text(r.get(spec["key"])) if spec["key"] else None
    data, ref, err, detail = _image_cell(r.get(spec["image"]), f.parent, cfg)
    cap = r.get(cfg.caption_column)
    if isinstance(cap, list):   # source.caption_list: first (checked by plan)
        cap = cap[0] if cap else None
    caption, ok = caption_bytes(cap)
    if spec.get("img2dataset") and r.get("status") not in (None, "success"):
        err = R.DOWNLOAD_FAILED
    elif not ok and err is None:
        err = R.BAD_CAPTION
    extra = {c: r.get(c) for c in cfg.extra_columns if c in r}
    if err == R.DOWNLOAD_FAILED and r.get("error_message"):
        extra["error_message"] = r["error_message"]
    if detail:
        extra[F.EXTRA_ERROR_KEY] = detail
    return {F.KEY.name: keys.real(key) or keys.invent(f"{f.name}:{spec['offset'] + i}"),
            F.IMAGE_REF.name: ref or f"{f.name}:{spec['offset'] + i}",
            F.RAW_IMAGE.name: data, F.RAW_CAPTION.name: caption,
            F.EXTRA.name: _extra(extra), F.READ_ERROR.name: err}


def _read_parquet(cfg: Any, spec: dict) -> pa.Table:
    f = src_path(spec["file"], cfg.path)
    if "bad_file" in spec:
        return _records(cfg, [_reject(keys.invent(f"{f.name}:<bad_file>"), f.name,
                                      spec["reason"], spec["bad_file"])])
    where = [f"{f.name}:{spec['offset'] + i}" for i in range(spec["rows"])]
    over = spec["declared"] > spec["rows"] * cfg.max_image_bytes + (1 << 20)
    if over or safe.bomb(spec["declared"], spec["disk"]):   # never read
        why = (f"row group {spec['row_group']} declares {spec['declared']} bytes for "
               f"{spec['rows']} rows in a {spec['disk']}-byte file "
               f"({'> max_image_bytes per row' if over else 'a compression bomb'})")
        return _records(cfg, [_reject(keys.invent(k), k, R.FILE_TOO_LARGE, why) for k in where])
    try:
        rows = [_parquet_record(cfg, spec, f, i, r) for i, r in enumerate(_parquet_rows(cfg, spec))]
        if len(rows) != spec["rows"]:
            raise ValueError(f"read {len(rows)} rows, the footer says {spec['rows']}")
    except Exception as e:  # a corrupt page: every record of the row group is a reject
        named = _row_group_keys(cfg, spec)          # (under its own key, if that column reads)
        rows = [_reject(keys.real(k) or keys.invent(w), w, R.BAD_RECORD, safe.detail(e))
                for k, w in zip(named, where)]
    return _records(cfg, rows)


def _row_group_keys(cfg: Any, spec: dict) -> list:
    """The key column of a row group whose other columns cannot be read (Nones if it cannot
    be read either, or there is none)."""
    if spec["key"]:
        try:
            with safe.open_regular(src_path(spec["file"], cfg.path)) as fh:
                t = pq.ParquetFile(fh).read_row_group(spec["row_group"], columns=[spec["key"]])
            if t.num_rows == spec["rows"]:
                return [_text(k) for k in t.column(0).to_pylist()]
        except Exception:
            pass
    return [None] * spec["rows"]


# --- WebDataset tars (and img2dataset's webdataset / files output) --------------------------------
def _record_from_group(g: tars.Group, ref_prefix: str, where: str) -> dict:
    ext = next((e for e in IMAGE_EXTS if g.fields.get(e) is not None), None)
    meta: Any = {}
    if g.fields.get("json") is not None:
        try:
            meta = json.loads(g.fields["json"].decode("utf-8", "surrogateescape"))
        except (ValueError, RecursionError):
            meta = {}
    caption, ok = g.fields.get("txt"), True
    if caption is None and isinstance(meta, dict):
        caption, ok = caption_bytes(meta.get("caption"))
    err = g.error or (None if ext else R.MISSING_IMAGE) or (None if ok else R.BAD_CAPTION)
    extra = g.fields["json"].decode("utf-8", "replace") if g.fields.get("json") else None
    return {F.KEY.name: keys.real(g.key) or keys.invent(where),
            F.IMAGE_REF.name: f"{ref_prefix}{g.key}.{ext or '?'}",
            F.RAW_IMAGE.name: g.fields.get(ext) if ext and not g.error else None,
            F.RAW_CAPTION.name: caption,
            F.EXTRA.name: _with_error(extra, g.detail) if g.error else extra,
            F.READ_ERROR.name: err}


def _group_rows(groups: Iterable[tars.Group], prefix: str) -> tuple[list[dict], list[str]]:
    """(records, each one's key as its shard names it: the member names' stem)."""
    rows, names = [], []
    for i, g in enumerate(groups):
        rows.append(_record_from_group(g, prefix, f"{prefix}{i}"))
        names.append(g.key)
    return rows, names


STATUS_COLUMNS = ("key", "url", "caption", "status", "error_message")


def read_statuses(parquet: Path | ObjPath) -> Optional[list[dict]]:
    """img2dataset's status rows for one shard (every attempted download: key, url, caption,
    status, error_message); None when there is no such file. Raises when it is not Parquet."""
    if not parquet.exists():
        return None
    with safe.open_regular(parquet) as fh:
        pf = pq.ParquetFile(fh)
        want = [c for c in STATUS_COLUMNS if c in pf.schema_arrow.names]
        return pf.read(columns=want).to_pylist()


def _status_reject(r: dict, where: str, reason: str, error: Optional[str]) -> dict:
    caption, _ = caption_bytes(r.get("caption"))
    extra = {"error_message": r.get("error_message")} if reason == R.DOWNLOAD_FAILED else \
        {F.EXTRA_ERROR_KEY: error}
    return {F.KEY.name: keys.real(_text(r.get("key"))) or keys.invent(where),
            F.IMAGE_REF.name: _text(r.get("url")) or where, F.RAW_CAPTION.name: caption,
            F.EXTRA.name: _extra(extra), F.READ_ERROR.name: reason}


def _with_statuses(rows: list[dict], names: list[str], parquet: Path | ObjPath,
                   shard: str) -> list[dict]:
    """A shard's records: its samples, then a reject for each status row no sample stands for.
    A success row stands for one sample of its key; a success row left over (its sample is not
    in the shard, or the shard is missing) is ``missing_file``, a failed one
    ``download_failed``; a sample that no success row names is kept as it is."""
    try:
        statuses = read_statuses(parquet)
    except Exception as e:
        return rows + [_reject(keys.invent(f"{parquet.name}:<bad_file>"), parquet.name,
                               R.BAD_FILE, safe.detail(e))]
    have = collections.Counter(names)
    for i, r in enumerate(statuses or []):
        where, key = f"{parquet.name}:{i}", _text(r.get("key"))
        if r.get("status") not in (None, "success"):
            rows.append(_status_reject(r, where, R.DOWNLOAD_FAILED, None))
        elif have[key] > 0:
            have[key] -= 1
        else:
            rows.append(_status_reject(r, where, R.MISSING_FILE,
                                       f"status success in {parquet.name}, no sample in {shard}"))
    return rows


def shard_parquet(path: Path | ObjPath) -> Path | ObjPath:
    """img2dataset's status file of a shard (00000.tar, 00000.tar.gz or the folder 00000)."""
    name = path.name.removesuffix(".gz").removesuffix(".tgz").removesuffix(".tar")
    return path.parent / f"{name}.parquet"


def _read_tar(cfg: Any, spec: dict) -> pa.Table:
    path = src_path(spec["file"], cfg.path)
    end = tars.TarEnd()
    rows, names = _group_rows(tars.groups(tars.read(
        path if isinstance(path, ObjPath) else spec["file"], cfg.max_image_bytes, end)),
        f"{path.name}:")
    if end.error:  # a truncated or corrupt tar: keep what was read, and say what was not
        rows.append(_reject(keys.invent(f"{path.name}:<unreadable>"), path.name, end.error,
                            end.detail))
    if spec.get("statuses"):
        rows = _with_statuses(rows, names, shard_parquet(path), path.name)
    return _records(cfg, rows)


def _read_orphan_statuses(cfg: Any, spec: dict) -> pa.Table:
    """An img2dataset status file whose shard is missing: every row is a reject."""
    path = src_path(spec["statuses_only"], cfg.path)
    return _records(cfg, _with_statuses([], [], path, spec["shard"]))


def _dir_members(cfg: Any, d: Path | ObjPath) -> Iterable[tars.Member]:
    entries = d.iterdir() if isinstance(d, ObjPath) else os.scandir(d)
    for e in sorted(entries, key=lambda e: e.name):
        if e.name.endswith((".parquet", "_stats.json")) or e.is_dir():
            continue
        data, reason, detail = safe.read_member(d, e.name, src_path(cfg.path),
                                                limit=cfg.max_image_bytes,
                                                allow_outside=cfg.allow_outside_source)
        yield tars.Member(clean_text(e.name), data, reason, detail)


def _read_files_dir(cfg: Any, spec: dict) -> pa.Table:
    d = src_path(spec["dir"], cfg.path)
    rows, names = _group_rows(tars.groups(_dir_members(cfg, d)), f"{d.name}/")
    return _records(cfg, _with_statuses(rows, names, shard_parquet(d), f"{d.name}/"))


# --- dispatch -------------------------------------------------------------------------------------
def _hint(root: Path, kind: str) -> str:
    """What the folder does hold, when it is not what source.kind expects."""
    if not root.is_dir():
        return ""
    found = {k: len(_files(root, s)) for k, s in (("webdataset", TAR_SUFFIXES),
                                                   ("parquet", (".parquet",)))}
    found["folder"] = sum((root / n).exists() for n in CAPTION_FILES)
    label = {"webdataset": ".tar shard(s)", "parquet": ".parquet file(s)",
             "folder": "captions file(s)"}
    other = [f"{n} {label[k]}" for k, n in found.items() if n and k != kind]
    return f"; it holds {', '.join(other)}: is source.kind right?" if other else ""


def _i2d_shard_dir(p: Path) -> bool:
    """img2dataset's files layout: a folder of images named like its shards (00000/), or with
    the shard's sibling files (00000.parquet, 00000_stats.json); not a folder source's images/."""
    if not p.is_dir() or not any(q.suffix.lstrip(".").lower() in IMAGE_EXTS for q in p.iterdir()):
        return False
    return p.name.isdigit() or p.with_suffix(".parquet").exists() \
        or (p.parent / f"{p.name}_stats.json").exists()


def img2dataset_layout(root: Path) -> str:
    if _files(root, TAR_SUFFIXES):
        return "tar"
    if any(_i2d_shard_dir(p) for p in root.iterdir()):
        return "files"
    if _files(root, (".parquet",)):
        return "parquet"
    raise SourceError(f"{root}: no img2dataset output found (no .tar shards, image folders or "
                      f".parquet files){_hint(root, 'img2dataset')}")


def _root(cfg: Any) -> Path | ObjPath:
    root = src_path(cfg.path)
    if not cfg.path or not root.exists():
        raise SourceError(f"source.path does not exist: {cfg.path!r}")
    return root


def _plan_tars(cfg: Any, root: Path) -> list[dict]:
    shards = _files(root, TAR_SUFFIXES)
    if not shards:
        raise SourceError(f"no .tar / .tar.gz / .tgz shards in {root}{_hint(root, 'webdataset')}")
    i2d = cfg.kind == "img2dataset"
    orphans = _orphan_statuses(root, shards) if i2d else []
    if not orphans and all(_empty_tar(f) for f in shards):
        raise SourceError(f"{root}: no records (every tar shard is an empty archive)")
    specs = [{"file": str(f), "statuses": i2d} for f in shards] + orphans
    return [dict(s, part=i) for i, s in enumerate(specs)]


def _orphan_statuses(root: Path, shards: list) -> list[dict]:
    """img2dataset status files whose shard (a tar, or a folder of files) is missing."""
    named = {str(shard_parquet(p)) for p in shards}
    return [{"statuses_only": str(p), "shard": f"{p.stem}.tar"}
            for p in _files(root, (".parquet",)) if str(p) not in named]


def _empty_tar(path: Path) -> bool:
    """An archive with only its end-of-archive block (a 0-byte file is a bad file instead)."""
    end = tars.TarEnd()
    where = path if isinstance(path, ObjPath) else str(path)
    return next(tars.read(where, 1 << 20, end), None) is None and end.error is None


def plan(cfg: Any, plan_path: str | Path) -> list[dict]:
    """The parts of the source, each a JSON-able dict with a ``part`` index."""
    forget_listings()         # a bucket source: list it afresh
    root = _root(cfg)
    if cfg.kind == "folder":
        return _plan_folder(cfg, str(plan_path))
    if cfg.kind == "parquet":
        return _plan_parquet(cfg)
    layout = "tar" if cfg.kind == "webdataset" else img2dataset_layout(root)
    if layout == "tar":
        return _plan_tars(cfg, root)
    if layout == "files":
        dirs = sorted(p for p in root.iterdir() if p.is_dir())
        specs = [{"dir": str(d)} for d in dirs] + [
            dict(o, shard=o["shard"].removesuffix(".tar") + "/")
            for o in _orphan_statuses(root, dirs)]
        return [dict(s, part=i) for i, s in enumerate(specs)]
    return _plan_parquet(cfg, i2d=True)


def read_part(cfg: Any, spec: dict) -> pa.Table:
    if cfg.kind == "folder":
        return _read_folder(cfg, spec)
    if "dir" in spec:
        return _read_files_dir(cfg, spec)
    if "statuses_only" in spec:
        return _read_orphan_statuses(cfg, spec)
    if spec.get("file", "").endswith(TAR_SUFFIXES):
        return _read_tar(cfg, spec)
    return _read_parquet(cfg, spec)


def _stat(p: Path | ObjPath) -> str:
    if isinstance(p, ObjPath):       # from the source's one LIST
        return p.signature()
    try:
        st = p.stat()
    except OSError:  # a dangling link: its own mtime still changes when it is replaced
        st = p.lstat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def signature(cfg: Any) -> str:
    """A cheap fingerprint of the source's content: names, sizes and mtimes of its index files."""
    forget_listings()
    root = _root(cfg)
    if cfg.kind == "folder":
        files = [captions_path(cfg)]
    elif root.is_file():
        files = [root]
    elif isinstance(root, ObjPath):   # an object store has no folder mtimes: every object
        files = root.walk_files()
    else:  # shards and metadata files; a files-layout folder changes its own mtime
        files = [p for p in sorted(root.rglob("*")) if p.name.endswith((*TAR_SUFFIXES, ".parquet"))
                 or (p.is_dir() and p.parent == root)]
    h = hashlib.sha256()
    for p in files:
        name = p.relative_to(root) if p != root else p.name
        h.update(f"{name}:{_stat(p)}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


__all__ = ["plan", "read_part", "signature", "source_name", "SourceError"]
