"""Where run directories, sources, shards and checkpoints live: a local path or any URI that
pyarrow.fs opens (``s3://``, ``gs://``, ``hdfs://``, ``file://``), else one fsspec opens (wrapped
in pyarrow's ``FSSpecHandler``). One code path for all of them: every read and write goes
through a ``pyarrow.fs.FileSystem``, local paths through ``LocalFileSystem``.

Credentials come only from the standard chains (for S3: ``AWS_ACCESS_KEY_ID``/``_SECRET_...``,
``AWS_PROFILE`` and ``~/.aws``, instance roles; ``AWS_ENDPOINT_URL`` and ``AWS_DEFAULT_REGION``
for an S3-compatible endpoint; for GCS: ``GOOGLE_APPLICATION_CREDENTIALS`` or the metadata
server). A URI that carries a secret (``s3://KEY:SECRET@bucket``, ``?secret_key=``) is never
written anywhere as given: :func:`redact` it first.
"""
from __future__ import annotations

import functools
import json
import os
import re
import uuid
from typing import Any, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import pyarrow.fs as pafs

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_SECRET_KEYS = {"secret_key", "access_key", "session_token", "token", "password", "credentials",
                "sig", "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token"}


def scheme(uri: str) -> str:
    """``s3``, ``gs``, ... ; ``""`` for a local path (``file://`` counts as local)."""
    m = _SCHEME.match(str(uri))
    s = m.group(1).lower() if m else ""
    return "" if s == "file" else s


def is_local(uri: str) -> bool:
    return scheme(uri) == ""


def local_path(uri: str) -> str:
    """The filesystem path of a local URI (``file:///x`` -> ``/x``; a plain path is itself)."""
    s = str(uri)
    return s[len("file://"):] if s.startswith("file://") else s


def join(base: str, *parts: str) -> str:
    """``base/part/...``; a URI's query (``?region=...``) stays at the end."""
    if not is_local(base) and "?" in str(base):
        u = urlsplit(str(base))
        return urlunsplit((u.scheme, u.netloc, join(u.path or "/", *parts), u.query, ""))
    out = str(base).rstrip("/") if str(base) not in ("/", "") else str(base)
    for p in parts:
        p = str(p).strip("/")
        if p:
            out = f"{out}/{p}" if out and not out.endswith("/") else f"{out}{p}"
    return out


def redact(uri: Any) -> Any:
    """The URI with any user info and secret query values replaced by ``***`` (non-strings and
    local paths are returned unchanged)."""
    if not isinstance(uri, str) or is_local(uri):
        return uri
    u = urlsplit(uri)
    netloc = u.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = urlencode([(k, "***" if k.lower() in _SECRET_KEYS else v)
                       for k, v in parse_qsl(u.query, keep_blank_values=True)])
    return urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


def redact_tree(obj: Any) -> Any:
    """``obj`` (dicts, lists, strings: a config dump) with every URI in it redacted."""
    if isinstance(obj, dict):
        return {k: redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_tree(v) for v in obj)
    return redact(obj)


@functools.lru_cache(maxsize=64)
def _filesystem(key: str) -> pafs.FileSystem:
    if key == "":
        return pafs.LocalFileSystem()
    try:
        fs, _ = pafs.FileSystem.from_uri(key)
        return _delayed_open(fs)
    except (ValueError, OSError) as e:    # pyarrow.ArrowInvalid is a ValueError
        arrow_error = e
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem
        return PyFileSystem(FSSpecHandler(fsspec.filesystem(scheme(key))))
    except (ImportError, ValueError) as e:
        raise ValueError(f"{redact(key)}: no filesystem opens this URI ({arrow_error}; "
                         f"fsspec: {e})") from None


def _delayed_open(fs: pafs.FileSystem) -> pafs.FileSystem:
    """An S3 filesystem with the same options and ``allow_delayed_open``: a small object is then
    written with one PUT, not a multipart upload (create, part, complete: three requests)."""
    if not isinstance(fs, pafs.S3FileSystem):
        return fs
    rebuild, (options,) = fs.__reduce__()
    return rebuild({**options, "allow_delayed_open": True})


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a path or URI. Filesystems are cached per scheme and
    authority (bucket), so resolving many paths of one bucket makes one client."""
    uri = str(uri)
    if is_local(uri):
        return _filesystem(""), os.path.abspath(local_path(uri))
    u = urlsplit(uri)
    key = urlunsplit((u.scheme, u.netloc, "/", u.query, ""))
    bucket = u.netloc.rsplit("@", 1)[-1]      # less any KEY:SECRET@ (the client has them)
    fs = _filesystem(key)
    if isinstance(fs, pafs.PyFileSystem):     # fsspec's: its own idea of the path
        return fs, fs.handler.fs._strip_protocol(f"{u.scheme}://{bucket}{u.path}").rstrip("/")
    return fs, (bucket + u.path).rstrip("/") if scheme(uri) in ("s3", "gs", "gcs") \
        else u.path.rstrip("/")


# --- small whole-object operations ----------------------------------------------------------------
def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def size(uri: str) -> Optional[int]:
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    return info.size if info.type == pafs.FileType.File else None


def read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole object atomically: an object store's PUT is; locally a temporary file is
    renamed over the target, so a reader never sees half an object."""
    fs, path = resolve(uri)
    if isinstance(fs, pafs.LocalFileSystem):
        ensure_parent(fs, path)
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with fs.open_output_stream(tmp) as f:
            f.write(data)
        os.replace(tmp, path)
        return
    with fs.open_output_stream(path) as f:
        f.write(data)


def ensure_parent(fs: pafs.FileSystem, path: str) -> None:
    """Create the folder ``path`` goes in, on a local filesystem only: an object store has no
    folders (pyarrow would PUT empty marker objects, one per level)."""
    parent = path.rsplit("/", 1)[0]
    if parent and isinstance(fs, pafs.LocalFileSystem):
        fs.create_dir(parent, recursive=True)


def read_json(uri: str) -> Optional[dict]:
    """The JSON object at ``uri``; None when it is missing or not (yet) valid JSON."""
    try:
        return json.loads(read_bytes(uri))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    except OSError as e:   # object stores raise OSError for a missing key
        if "not found" in str(e).lower() or "no such" in str(e).lower() or "404" in str(e):
            return None
        raise


def write_json(uri: str, obj: Any) -> None:
    write_bytes(uri, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())


def listdir(uri: str) -> list[pafs.FileInfo]:
    """The entries directly under ``uri`` (one LIST on an object store); [] when it is absent."""
    fs, path = resolve(uri)
    return fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=False))


def makedirs(uri: str) -> None:
    fs, path = resolve(uri)
    fs.create_dir(path, recursive=True)


def delete(uri: str) -> None:
    """Remove a file or a whole directory (prefix); nothing if it is absent."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif info.type == pafs.FileType.File:
        fs.delete_file(path)


def list_files(uri: str) -> list[pafs.FileInfo]:
    """Every file under ``uri``, recursively (one paginated LIST on an object store); [] when it
    is absent."""
    fs, path = resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=True))
    return [i for i in infos if i.type == pafs.FileType.File]


def upload_dir(local_dir: str, uri: str) -> None:
    """Copy the folder ``local_dir`` (recursively) to ``uri``, a path or URI; nothing to do when
    they are the same place."""
    _copy_tree(local_dir, uri)


def download_dir(uri: str, local_dir: str) -> None:
    """Copy everything under ``uri`` to the local folder ``local_dir`` (created if needed)."""
    _copy_tree(uri, local_dir)


def _copy_tree(src: str, dst: str) -> None:
    sfs, spath = resolve(src)
    dfs, dpath = resolve(dst)
    if is_local(src) and is_local(dst) and os.path.realpath(spath) == os.path.realpath(dpath):
        return
    dfs.create_dir(dpath, recursive=True)
    if not list_files(src):      # copy_files refuses an empty or missing source
        return
    pafs.copy_files(spath, dpath, source_filesystem=sfs, destination_filesystem=dfs)


def forget_clients() -> None:
    """Drop the cached filesystem clients (after the endpoint or credentials in the environment
    changed, as in tests)."""
    _filesystem.cache_clear()
