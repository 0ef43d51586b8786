"""Tars that declare more than they hold, through ``vlcurate run``: a member cut short while read,
and a member whose header declares a terabyte (GNU base-256 size, or a PAX ``size`` record, in a
plain or a gzip tar) or more than the file holds. The reader writes the rows it could read and
one ``<unreadable>`` row per damaged file, the second count (``census``) counts the same, and
the summary says no row was lost; no read allocates what a header declares."""
from __future__ import annotations

import gzip
import json
import tarfile
import tracemalloc
from pathlib import Path

import pyarrow.dataset as ds
import pytest
import yaml

from . import corpus
from vlcurate.pipeline.cli import main
from vlcurate.schemas import F
from vlcurate.schemas import reasons as R
from vlcurate.stages.ingest import census, tars
from vlcurate.stages.ingest.keys import invent

pytestmark = pytest.mark.timeout(180)
TB = 1 << 40
LIMIT = 50_000          # source.max_image_bytes
BAD = [R.BAD_RECORD, R.MISSING_CAPTION]     # the <unreadable> row's reasons


def member(name: str, data: bytes, declared: int | None = None,
           fmt: int = tarfile.GNU_FORMAT) -> bytes:
    """One member's header and data blocks; ``declared``: the size its header claims (GNU:
    base-256 above 8 GiB; PAX: a ``size`` record), of which the file holds only ``data``."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data) if declared is None else declared, 1_700_000_000
    return info.tobuf(fmt, "utf-8", "surrogateescape") + data + bytes(-len(data) % 512)


def sample(key: str, seed: int) -> bytes:
    return member(f"{key}.jpg", corpus.jpeg(24, 16, seed=seed)) + \
        member(f"{key}.txt", f"a photo {key}".encode())


END = bytes(1024)       # the end-of-archive blocks


def hostile_tars(root: Path) -> dict[str, list[tuple[str, list[str]]]]:
    """{file: its expected rows (key, reasons)}: every case beside a clean tar."""
    root.mkdir(parents=True)
    jpg = corpus.jpeg(24, 16, seed=9)
    cases = {
        "00000.tar": sample("a0", 0) + sample("a1", 1) + END,                  # clean
        # truncated: b1's image is cut in its data (the header declares what was written)
        "00001.tar": sample("b0", 2) + member("b1.jpg", jpg)[:512 + len(jpg) // 2],
        # a terabyte in a GNU base-256 size field, 300 bytes behind it
        "00002.tar": sample("c0", 3) + member("c1.jpg", b"x" * 300, TB),
        # a terabyte in a PAX size record, gzip-compressed
        "00003.tar.gz": gzip.compress(sample("d0", 4) + member("d1.jpg", b"x" * 300, TB,
                                                               tarfile.PAX_FORMAT)),
        # over the limit and more than the file holds; then under the limit, the same
        "00004.tar": sample("e0", 5) + member("e1.jpg", b"x" * 300, 10 * LIMIT),
        "00005.tar": sample("f0", 6) + member("f1.txt", b"cap") + member("f1.jpg", jpg[:99],
                                                                           len(jpg)),
        # a terabyte declared by the first member: the file is all damage
        "00006.tar": member("g0.jpg", b"x" * 300, TB),
    }
    for name, data in cases.items():
        (root / name).write_bytes(data)
    rows = {"00001.tar": ["b0"], "00002.tar": ["c0"], "00003.tar.gz": ["d0"], "00004.tar": ["e0"],
            "00005.tar": ["f0", "f1"], "00006.tar": []}
    expected = {n: [(k, [R.MISSING_IMAGE] if k == "f1" else []) for k in keys]
                + [(invent(f"{n}:<unreadable>"), BAD)] for n, keys in rows.items()}
    return {"00000.tar": [("a0", []), ("a1", [])], **expected}


def test_the_reader_and_the_second_count_agree_on_every_damaged_tar(tmp_path):
    """File by file: the reader's rows (what it read, plus <unreadable> when the file is
    damaged) and the census's count are one number; the reading never allocates more than a few
    MiB, whatever a header declares."""
    expected = hostile_tars(tmp_path / "src")
    for name, rows in expected.items():
        tracemalloc.start()
        end = tars.TarEnd()
        groups = list(tars.groups(tars.read(str(tmp_path / "src" / name), LIMIT, end)))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 8 << 20, (name, peak)
        assert (end.error is None) == (name == "00000.tar"), (name, end.detail)
        assert [g.key for g in groups] == [k for k, _ in rows][:len(rows) - bool(end.error)]
        keys, damaged = census.tar_keys(tmp_path / "src" / name, LIMIT)
        assert len(keys) + damaged == len(groups) + (end.error is not None) == len(rows), name
    detail = {n: tars.TarEnd() for n in ("00002.tar", "00003.tar.gz")}
    for n, end in detail.items():
        list(tars.read(str(tmp_path / "src" / n), LIMIT, end))
        assert f"declares {TB} bytes; the file ends before them (truncated)" in end.detail, n


def test_damaged_tars_through_a_run_balance_the_books(tmp_path, capsys):
    expected = hostile_tars(tmp_path / "src")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "source": {"kind": "webdataset", "path": str(tmp_path / "src"), "name": "wds",
                   "max_image_bytes": LIMIT},
        "run": {"run_dir": str(tmp_path / "run"), "progress": False, "stages": ["ids"],
                "max_reject_fraction": 1.0}}))
    code = main(["run", str(config), "--executor", "local"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no row lost: yes" in out and "checked against the sources' second count: " \
        f"{sum(map(len, expected.values()))} records in {len(expected)} files" in out, out
    rows = ds.dataset(tmp_path / "run" / "ingest" / "data", format="parquet").to_table()
    got = sorted((r[F.KEY.name], r[F.REASONS.name]) for r in rows.to_pylist())
    assert got == sorted((k, v) for rs in expected.values() for k, v in rs)
    books = json.loads((tmp_path / "run" / "ingest" / "_census.json").read_text())
    counts = {Path(u).name: c[:2] for b in books for u, c in b["counts"].items()}
    assert counts == {n: [len(rs), len(rs)] for n, rs in expected.items()}
