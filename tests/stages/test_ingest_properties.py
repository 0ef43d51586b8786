"""Property test: random byte-level and structure-level mutations of valid sources, in every
source format, never raise out of ingest (only :class:`SourceError` from ``plan``, before any
part runs), never hang, and always balance the books: against the source's second count too.

The default suite runs ``VLCURATE_HOSTILE_CASES`` (350) cases per format, 2100 in all; set it
higher, and ``VLCURATE_HOSTILE_SEED``, for a longer search: a failure names its seed and case.
"""
from __future__ import annotations

import gzip
import os
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from . import hostile
from .hostile import FOLDER, FORMATS, good
from vlcurate.pipeline.runner import build_stage
from vlcurate.schemas import F
from vlcurate.schemas import reasons as R
from vlcurate.stages.ingest import IngestStage, census, readers
from vlcurate.stages.ingest.readers import SourceError

CASES = int(os.environ.get("VLCURATE_HOSTILE_CASES", "350"))
SEED = int(os.environ.get("VLCURATE_HOSTILE_SEED", "0"))
SPECIAL = [b'"', b",", b"\t", b"\n", b"\r", b"\0", b"\xff", b"{", b"}", b"\\", b"\xef\xbb\xbf",
           b'""', b"\xe2\x80\x8b", b"\xed\xa0\x80"]
N = 6   # records in every base source


def _records() -> list[dict]:
    recs = [good(f"g{i}", i, caption=f"caption {i}, with \"quotes\"\nand a newline".encode())
            for i in range(N - 1)]
    return recs + [dict(good("junk", 9), image=b"not an image")]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _restore(root: Path, files: dict[str, bytes]) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


# --- mutations ------------------------------------------------------------------------------------
def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    at = rng.randrange(len(b) + 1) if rng.random() < 0.5 else rng.randrange(min(len(b), 600) + 1)
    if op == 0 and b:                                   # flip bytes
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 1:                                       # insert special or random bytes
        b[at:at] = rng.choice(SPECIAL) if rng.random() < 0.7 else rng.randbytes(rng.randint(1, 64))
    elif op == 2:                                       # delete a range
        del b[at:at + rng.randint(1, 700)]
    elif op == 3:                                       # truncate
        del b[at:]
    elif op == 4:                                       # append junk (or the file again)
        b += rng.choice([bytes(b), rng.randbytes(rng.randint(1, 2000)), bytes(1024)])
    else:                                               # overwrite a range with one special
        s = rng.choice(SPECIAL)
        b[at:at + len(s)] = s
    return bytes(b)


def mutate_lines(rng: random.Random, data: bytes) -> bytes:
    lines = data.split(b"\n")
    i = rng.randrange(len(lines))
    op = rng.randrange(5)
    if op == 0:
        lines.insert(i, lines[rng.randrange(len(lines))])          # duplicate a line
    elif op == 1 and len(lines) > 1:
        del lines[i]                                                # drop one
    elif op == 2:
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]                     # swap two
    elif op == 3:
        lines[i] = lines[i][: rng.randrange(len(lines[i]) + 1)]    # cut a line short
    else:
        lines.insert(i, rng.choice([b'x,"', b"\t\t\t", b"[]", b"{}", b"null", b'"', b"a,b,c,d,e"]))
    return b"\n".join(lines)


def mutate_tar(rng: random.Random, root: Path, recs: list[dict]) -> None:
    members = hostile.tar_members(recs)
    op = rng.randrange(6)
    i = rng.randrange(len(members))
    if op == 0:
        members.insert(rng.randrange(len(members)), members[i])     # a duplicate member
    elif op == 1:
        del members[i]
    elif op == 2:
        rng.shuffle(members)
    elif op == 3:
        special = rng.choice(["fifo", "symlink:../x", "hardlink", "device", "sparse"])
        members[i] = (members[i][0], members[i][1], special)
    elif op == 4:
        members[i] = (members[i][0].replace(b"g", b"\xff", 1), members[i][1], "")
    else:
        members[i] = (members[i][0], rng.randbytes(rng.randint(0, 3000)), "")
    hostile.write_tar(root / "00000.tar", members)
    data = (root / "00000.tar").read_bytes()
    if rng.random() < 0.2:
        (root / "00000.tar").write_bytes(gzip.compress(data))
    elif rng.random() < 0.2:
        (root / "00000.tar").write_bytes(data + data)


def mutate_parquet(rng: random.Random, root: Path, recs: list[dict]) -> None:
    try:
        t = pq.read_table(root / "data.parquet")
    except Exception:   # an earlier byte mutation already broke it
        return
    op = rng.randrange(4)
    if op == 0:
        t = t.set_column(2, "caption", pa.array([rng.choice([None, "x", "\u200b"])
                                                  for _ in range(t.num_rows)]))
    elif op == 1:
        pool = [None, b"", rng.randbytes(50), *(r["image"] for r in recs)]
        t = t.set_column(1, "image", pa.array([rng.choice(pool) for _ in range(t.num_rows)],
                                              pa.binary()))
    elif op == 2:
        t = pa.concat_tables([t, t.slice(0, rng.randint(0, t.num_rows))])
    pq.write_table(t, root / "data.parquet", row_group_size=rng.randint(1, 4),
                   compression=rng.choice(["none", "snappy", "zstd"]))


def mutate(rng: random.Random, fmt: str, root: Path, recs: list[dict]) -> bool:
    """Apply 1-3 mutations; True when only record content changed (so the count is known)."""
    content_only = True
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.3:                                  # an image's bytes: content only
            name = rng.choice([p for p in (root / "images").iterdir()]) if fmt in FOLDER else None
            if name is not None:
                name.write_bytes(mutate_bytes(rng, name.read_bytes()))
                continue
        content_only = False
        if fmt in FOLDER:
            p = root / f"captions.{fmt}"
            p.write_bytes((mutate_lines if kind < 0.6 else mutate_bytes)(rng, p.read_bytes()))
        elif fmt == "parquet":
            if kind < 0.6:
                mutate_parquet(rng, root, recs)
            else:
                p = root / "data.parquet"
                p.write_bytes(mutate_bytes(rng, p.read_bytes()))
        elif kind < 0.6:
            mutate_tar(rng, root, recs)
        else:
            p = root / "00000.tar"
            p.write_bytes(mutate_bytes(rng, p.read_bytes()))
    return content_only


# --- the property ---------------------------------------------------------------------------------
def _physical_records(fmt: str, root: Path) -> int:
    """Non-blank physical lines of a captions file (less the header): an upper bound on rows."""
    lines = [x for x in (root / f"captions.{fmt}").read_bytes().split(b"\n") if x.strip()]
    return max(len(lines) - (fmt != "jsonl"), 0)


def _parquet_records(path: Path) -> int:
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:
        return 1


def ingest_balanced(cfg, tmp: Path) -> list[dict]:
    """Plan (may raise SourceError), then every part through the reader and the stage: these
    must not raise, and every row out is one row in, kept or rejected with known reasons."""
    specs = readers.plan(cfg.source, tmp / "plan.parquet")
    stage, rows, per_part = build_stage(IngestStage, cfg), [], []
    for s in specs:
        raw = readers.read_part(cfg.source, s)
        out = stage(raw)
        assert out.num_rows == raw.num_rows
        assert out.column(F.KEY.name).to_pylist() == raw.column(F.KEY.name).to_pylist()
        rows += out.to_pylist()
        per_part.append(out.num_rows)
    books = census.count_all([census.record(cfg.source, specs, "src")])     # the second count
    books = census.check(books, per_part)
    assert books["lost"] == [], books
    for r in rows:
        reasons = r[F.REASONS.name]
        assert set(reasons) <= set(R.INGEST), reasons
        if not reasons:
            assert r[F.IMAGE.name] and r[F.CAPTION.name], r[F.KEY.name]
    return rows


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
def test_random_mutations_never_raise_never_hang_always_balance(fmt, tmp_path):
    recs = _records()
    template = hostile.write(fmt, tmp_path / "template", recs)
    files, root = _snapshot(template), tmp_path / "case"
    cfg = hostile.config(fmt, root)
    rng = random.Random(f"{SEED}:{fmt}")
    stats = {"source_error": 0, "kept": 0, "rejected": 0, "content_only": 0}
    for case in range(CASES):
        _restore(root, files)
        content_only = mutate(rng, fmt, root, recs)
        try:
            rows = ingest_balanced(cfg, tmp_path)
        except SourceError:
            assert not content_only, f"seed {SEED} case {case}"
            stats["source_error"] += 1
            continue
        except Exception as e:
            raise AssertionError(f"{fmt}: seed {SEED} case {case} raised {e!r}") from e
        if content_only:   # the records are the same ones: exactly one row each
            assert len(rows) == N, f"seed {SEED} case {case}"
            stats["content_only"] += 1
        elif fmt in FOLDER:
            assert len(rows) <= _physical_records(fmt, root), f"seed {SEED} case {case}"
        elif fmt == "parquet":   # a readable file: its footer's row count; an unreadable one: 1
            assert len(rows) == _parquet_records(root / "data.parquet"), f"seed {SEED} case {case}"
        kept = sum(not r[F.REASONS.name] for r in rows)
        stats["kept"] += kept
        stats["rejected"] += len(rows) - kept
    print(fmt, stats)
    assert stats["kept"] and stats["rejected"]
