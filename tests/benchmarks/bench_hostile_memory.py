"""Memory under hostile input: a ~10 kB source that claims gigabytes (a tar member declaring
10 GB, a gzip bomb, a sparse member, a PAX header asking for 4 GB, a zstd-compressed Parquet
cell of 400 MB, a 16-bit PNG header of 30000 x 30000, an ICO whose embedded PNG is larger than
its directory says, JSON nested 10,000 deep, unbalanced CSV quotes, a symlink to /dev/zero)
must never make the process that ingests it exceed its baseline RSS by more than
``source.max_image_bytes`` plus a small constant.

    .venv/bin/python tests/benchmarks/bench_hostile_memory.py [--max-image-bytes 67108864]

Each source is ingested (readers.plan + read_part + IngestStage, the stage's real read path) in
a fresh child process: imports and a warm-up run first, then the peak RSS (VmHWM) is reset
(/proc/self/clear_refs) and the hostile source ingested. Prints one row per source: its size on
disk, rows (= records), peak RSS over baseline, the bound, and whether it held.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

CONSTANT = 48 << 20                       # interpreter, pyarrow buffers, a decoded small image


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes]], gz: bool = False) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data else None)
    data = buf.getvalue()
    path.write_bytes(gzip.compress(data, 9) if gz else data)


def _info(name: str, size: int = 0, type_: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    i = tarfile.TarInfo(name)
    i.size, i.type = size, type_
    return i


def _small_jpeg() -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, "JPEG")
    return buf.getvalue()


def _png_header(w: int, h: int) -> bytes:
    def chunk(k: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 4096)) + chunk(b"IEND", b""))


def _declared_10gb(d: Path) -> dict:
    """A tar header declaring a 10 GB member, then end of file."""
    buf = _info("huge.jpg", 10 << 30).tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    (d / "00000.tar").write_bytes(buf + _info("huge.txt", 0).tobuf(tarfile.GNU_FORMAT, "utf-8",
                                                                   "surrogateescape"))
    return {"kind": "webdataset"}


def _gzip_bomb(d: Path) -> dict:
    """A .tar.gz: a 9 MB member of zeros (over the limit) + a good sample, about 10 kB."""
    _tar(d / "00000.tar.gz", [(_info("bomb.jpg", 9 << 20), bytes(9 << 20)),
                              (_info("ok.jpg", len(_small_jpeg())), _small_jpeg()),
                              (_info("ok.txt", 4), b"fine")], gz=True)
    return {"kind": "webdataset"}


def _sparse(d: Path) -> dict:
    """A GNU sparse member (its real size could be anything: never expanded)."""
    info = _info("sparse.jpg", 512, tarfile.GNUTYPE_SPARSE)
    _tar(d / "00000.tar", [(info, bytes(512))])
    return {"kind": "webdataset"}


def _pax_path(d: Path) -> dict:
    """A PAX extended header whose size field asks tarfile to read 4 GB of header."""
    pax = tarfile.TarInfo("././@PaxHeader")
    pax.type, pax.size = tarfile.XHDTYPE, 4 << 30
    raw = pax.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape") + b"30 path=" + b"x" * 8000
    (d / "00000.tar").write_bytes(raw)
    return {"kind": "webdataset"}


def _parquet_under_limit(d: Path) -> dict:
    """One cell of zeros one byte under max_image_bytes: allowed by the size limit, caught as a
    compression bomb (declared size / bytes on disk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"image": pa.array([bytes(LIMIT[0] - 1)], pa.binary()),
                             "caption": ["zeros"]}), d / "zeros.parquet",
                   compression="zstd", compression_level=19, use_dictionary=False)
    return {"kind": "parquet"}


def _gzip_under_limit(d: Path) -> dict:
    """A .tar.gz member of zeros just under the limit (gzip: at most ~1000x, so ~10 MB)."""
    n = min(LIMIT[0] - 1, 10 << 20)
    _tar(d / "00000.tar.gz", [(_info("zeros.jpg", n), bytes(n)), (_info("zeros.txt", 1), b"z")],
         gz=True)
    return {"kind": "webdataset"}


def _parquet_bomb(d: Path) -> dict:
    """One 400 MB cell of zeros, zstd-compressed into a few kB."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"image": pa.array([bytes(400 << 20)], pa.binary()),
                             "caption": ["a bomb"]}), d / "bomb.parquet",
                   compression="zstd", compression_level=19, use_dictionary=False)
    return {"kind": "parquet"}


def _folder(d: Path, images: dict[str, bytes], lines: list[bytes],
            links: dict | None = None) -> None:
    (d / "images").mkdir()
    for name, data in images.items():
        (d / "images" / name).write_bytes(data)
    for name, target in (links or {}).items():
        os.symlink(target, d / "images" / name)
    (d / "captions.csv").write_bytes(b"image,caption\n" + b"".join(lines))


def _png_bomb(d: Path) -> dict:
    _folder(d, {"bomb.png": _png_header(30000, 30000)}, [b"bomb.png,a 30000 x 30000 png\n"])
    return {"kind": "folder"}


def _ico_bomb(d: Path) -> dict:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (256, 256)).save(buf, "ICO", sizes=[(256, 256)])
    data = bytearray(buf.getvalue())
    # the embedded PNG says 256 x 256; make it say 20000 x 20000 (its directory still says 256)
    at = data.index(b"IHDR") + 4
    data[at:at + 8] = struct.pack(">II", 20000, 20000)
    crc_at = at + 13
    data[crc_at:crc_at + 4] = struct.pack(">I", zlib.crc32(bytes(data[at - 4:crc_at])))
    _folder(d, {"bomb.ico": bytes(data)}, [b"bomb.ico,an icon\n"])
    return {"kind": "folder"}


def _csv_quotes(d: Path) -> dict:
    """Every line opens a quote it never closes (each tries to swallow the rest)."""
    _folder(d, {"a.jpg": _small_jpeg()}, [b'a.jpg,"never closed %d\n' % i for i in range(600)])
    return {"kind": "folder"}


def _deep_json(d: Path) -> dict:
    _folder(d, {"a.jpg": _small_jpeg()}, [])
    (d / "captions.csv").unlink()
    (d / "captions.jsonl").write_bytes(b"[" * 10_000 + b"\n" + b'{"image": "a.jpg", '
                                       b'"caption": ' + b"[" * 5000 + b"]" * 5000 + b"}\n")
    return {"kind": "folder"}


def _dev_zero(d: Path) -> dict:
    _folder(d, {}, [b"zero.jpg,a link to /dev/zero\n", b"/dev/zero,an absolute path\n"],
            links={"zero.jpg": "/dev/zero"})
    return {"kind": "folder", "allow_outside_source": True}


SOURCES = {f.__name__.lstrip("_"): f for f in (
    _declared_10gb, _gzip_bomb, _gzip_under_limit, _sparse, _pax_path, _parquet_bomb,
    _parquet_under_limit, _png_bomb, _ico_bomb, _csv_quotes, _deep_json, _dev_zero)}
LIMIT = [8 << 20]     # max_image_bytes (set by main before the sources are written)


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    vals = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            vals[k] = int(v.split()[0]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _ingest(cfg, tmp: Path) -> int:
    from vlcurate.pipeline.runner import build_stage
    from vlcurate.stages.ingest import IngestStage, readers
    stage, n = build_stage(IngestStage, cfg), 0
    for s in readers.plan(cfg.source, tmp / "plan.parquet"):
        n += stage(readers.read_part(cfg.source, s)).num_rows
    return n


def child(name: str, tmp: Path, max_image_bytes: int) -> None:
    """Ingest the source the parent wrote at tmp/src (writing the 400 MB Parquet cell here
    would raise this process's baseline)."""
    from vlcurate.pipeline import config as C
    warm, src = tmp / "warm", tmp / "src"
    opts = json.loads((tmp / "opts.json").read_text())
    size = sum(p.lstat().st_size for p in src.rglob("*") if not p.is_dir())

    def cfg(path: Path, kind: str, **o):
        return C.load(None, {"source.path": str(path), "source.kind": kind,
                             "source.max_image_bytes": max_image_bytes,
                             "ingest.max_pixels": 4_000_000,
                             **{f"source.{k}": v for k, v in o.items()}})
    _ingest(cfg(warm, "folder"), tmp / "w")              # imports, allocator warm-up
    kind = opts.pop("kind")
    Path("/proc/self/clear_refs").write_text("5")        # reset the peak to the current RSS
    base, _ = _rss()
    t0 = time.perf_counter()
    rows = _ingest(cfg(src, kind, **opts), tmp / "r")
    wall = time.perf_counter() - t0
    _, peak = _rss()
    print(json.dumps({"name": name, "bytes": size, "rows": rows, "base": base, "peak": peak,
                      "wall": wall}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-image-bytes", type=int, default=64 << 20)   # the config default
    ap.add_argument("--child", default=None)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    if a.child:
        child(a.child, Path(a.dir), a.max_image_bytes)
        return 0
    LIMIT[0] = a.max_image_bytes
    bound = a.max_image_bytes + CONSTANT
    print(f"load average: {os.getloadavg()}; bound = max_image_bytes {a.max_image_bytes >> 20} "
          f"MiB + {CONSTANT >> 20} MiB")
    print(f"{'source':20} {'bytes':>7} {'rows':>5} {'base MiB':>9} {'peak-base MiB':>14} "
          f"{'wall s':>7}  held")
    ok = True
    for name, make in SOURCES.items():
        tmp = Path(tempfile.mkdtemp(prefix="vlc-hostile-"))
        for d in ("warm", "src"):
            (tmp / d).mkdir()
        _csv_quotes(tmp / "warm")
        (tmp / "opts.json").write_text(json.dumps(make(tmp / "src")))
        out = subprocess.run([sys.executable, __file__, "--child", name, "--dir", str(tmp),
                              "--max-image-bytes", str(a.max_image_bytes)],
                             capture_output=True, text=True, timeout=600)
        shutil.rmtree(tmp, ignore_errors=True)
        if out.returncode != 0:
            print(f"{name:20} FAILED: {out.stderr[-800:]}")
            ok = False
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        over = r["peak"] - r["base"]
        held = over <= bound
        ok &= held
        print(f"{name:20} {r['bytes']:7d} {r['rows']:5d} {r['base'] / 2**20:9.1f} "
              f"{over / 2**20:14.1f} {r['wall']:7.3f}  {'yes' if held else 'NO'}")
    print("every hostile source within the bound:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
