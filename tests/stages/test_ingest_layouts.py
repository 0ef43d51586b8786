"""Property test: random deletions, duplications and renames of tars (or img2dataset's shard
folders), status parquets and members (WebDataset and img2dataset), and captions files whose
keys are empty, null or look invented. Every case balances three ways: the rows the readers
give, the second count (``census``) and this test's own model of the layout agree, unit by
unit; an invented key never equals a real one, and no real key is lost.

The default suite runs ``VLCURATE_LAYOUT_CASES`` (600) cases per test (300 for the files
layout), 2,700 in all; set it higher, and ``VLCURATE_LAYOUT_SEED``, for a longer search: a
failure names its seed and case.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import random
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from . import corpus, hostile
from vlcurate.schemas import F
from vlcurate.stages.ingest import census, keys, sources, tars

CASES = int(os.environ.get("VLCURATE_LAYOUT_CASES", "600"))
SEED = int(os.environ.get("VLCURATE_LAYOUT_SEED", "0"))
KEYS = ["k0", "k1", "k2", "k3", "", "\u2205:00000.tar:0", "\u2205:00000.parquet:1", "\u2205k"]
STATUS_KEYS = KEYS + [None]
EXTS = ["jpg", "txt", "json", "JPG"]
IMAGE = corpus.jpeg(8, 8, seed=1)


# --- the model: shards of members and status rows -------------------------------------------------
def _base(rng: random.Random, i2d: bool) -> list[dict]:
    shards = []
    for s in range(rng.randint(1, 3)):
        ks = [rng.choice(KEYS) for _ in range(rng.randint(1, 4))]
        members = [(f"{k}.{e}", IMAGE if e.lower() == "jpg" else b"a caption")
                   for k in ks for e in ("jpg", "txt")]
        statuses = [(k, "success") for k in ks] if i2d else None
        if i2d:
            statuses += [(rng.choice(STATUS_KEYS), rng.choice(["success", "failed_to_download"]))
                         for _ in range(rng.randint(0, 2))]
        shards.append({"stem": f"{s:05d}", "tar": members, "statuses": statuses})
    return shards


OPS = ("delete a member", "duplicate a member", "rename a member", "duplicate the tar",
       "delete the tar", "delete the status file", "rename the tar", "rename the status file")


def _mutate(rng: random.Random, shards: list[dict], i2d: bool, seen: Counter) -> None:
    for _ in range(rng.randint(1, 4)):
        sh = rng.choice(shards)
        op = rng.randrange(8 if i2d else 5)
        seen[OPS[op]] += 1
        members = sh["tar"]
        if op == 0 and members:                                     # delete a member
            del members[rng.randrange(len(members))]
        elif op == 1 and members:                                   # duplicate a member
            members.insert(rng.randrange(len(members) + 1), rng.choice(members))
        elif op == 2 and members:                                   # rename a member
            i = rng.randrange(len(members))
            members[i] = (f"{rng.choice(KEYS)}.{rng.choice(EXTS)}", members[i][1])
        elif op == 3:                                               # duplicate the tar
            shards.append({"stem": f"{len(shards) + 10:05d}", "tar": list(members or []),
                           "statuses": list(sh["statuses"]) if sh["statuses"] and i2d else None})
        elif op == 4:                                               # delete the tar
            sh["tar"] = None
        elif op == 5:                                               # delete the status file
            sh["statuses"] = None
        elif op == 6:                                               # rename the tar
            shards.append({"stem": f"{len(shards) + 20:05d}", "tar": members, "statuses": None})
            sh["tar"] = None
        else:                                                       # rename the status file
            shards.append({"stem": f"{len(shards) + 30:05d}", "tar": None,
                           "statuses": sh["statuses"]})
            sh["statuses"] = None


def _write(root: Path, shards: list[dict], files: bool) -> None:
    """Each shard as a tar, or (``files``) as a folder of its members, and its status file."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for sh in shards:
        if sh["tar"] is not None and files:
            (root / sh["stem"]).mkdir()
            for n, d in sh["tar"]:
                (root / sh["stem"] / n).write_bytes(d)
        elif sh["tar"] is not None:
            hostile.write_tar(root / f"{sh['stem']}.tar",
                              [(n.encode(), d, "") for n, d in sh["tar"]])
        if sh["statuses"] is not None:
            ks = [k for k, _ in sh["statuses"]]
            pq.write_table(pa.table({"key": pa.array(ks, pa.string()),
                                     "caption": ["c"] * len(ks),
                                     "status": [s for _, s in sh["statuses"]]}),
                           root / f"{sh['stem']}.parquet")


def _groups(members: list) -> list[str]:
    """WebDataset records: runs of one key, a repeated extension starting a new one."""
    out, exts = [], set()
    for name, _ in members:
        key, _, ext = name.partition(".")
        if not out or key != out[-1] or ext.lower() in exts:
            out.append(key)
            exts = set()
        exts.add(ext.lower())
    return out


def expected(shards: list[dict], i2d: bool, files: bool) -> dict[str, int]:
    """Rows per unit: a tar's records; for img2dataset a shard's status rows plus its samples
    beyond the success rows of their key (a folder's members: its files, by name)."""
    out = {}
    for sh in shards:
        members = sorted(dict(sh["tar"]).items()) if files and sh["tar"] else sh["tar"]
        samples = _groups(members) if sh["tar"] is not None else []
        if not i2d:
            if sh["tar"] is not None:
                out[f"{sh['stem']}.tar"] = len(samples)
            continue
        if sh["tar"] is None and sh["statuses"] is None:
            continue
        success = Counter(k for k, s in sh["statuses"] or [] if s == "success")
        extra = sum(max(0, n - success[k]) for k, n in Counter(samples).items())
        out[f"{sh['stem']}.parquet"] = len(sh["statuses"] or []) + extra
    return out


# --- the property ---------------------------------------------------------------------------------
def ingest(cfg, tmp: Path) -> tuple[list[dict], dict, dict]:
    """Rows of every part, rows per unit, and the second count's check of them."""
    specs = sources.plan(cfg.source, str(tmp / "_plan.parquet"))
    books = json.loads((tmp / sources.CENSUS).read_text())
    rows, per_part = [], []
    for s in specs:
        part = sources.read_part(cfg.source, s).to_pylist()
        rows += part
        per_part.append(len(part))
    per_unit: Counter = Counter()
    for unit, n in zip(books[0]["parts"], per_part):
        per_unit[Path(unit).name] += n
    return rows, dict(per_unit), census.check(census.count_all(books), per_part)


def assert_keys_apart(rows: list[dict], real: list) -> None:
    """Invented keys are unique and never a real one; every real key arrives (escaped)."""
    stored = [r[F.KEY.name] for r in rows]
    made = [k for k in stored if keys.invented(k)]
    assert len(made) == len(set(made)), made
    assert not set(made) & {keys.real(k) for k in real if k}
    assert {keys.real(k) for k in real if k} <= set(stored)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["webdataset", "img2dataset", "img2dataset-files"])
def test_random_layouts_balance_against_the_second_count(kind, tmp_path):
    i2d, files = kind.startswith("img2dataset"), kind.endswith("files")
    rng = random.Random(f"{SEED}:{kind}")
    root, cfg = tmp_path / "src", corpus.config(tmp_path / "src", kind.removesuffix("-files"))
    seen = Counter()
    for case in range(CASES // (2 if files else 1)):
        shards = _base(rng, i2d)
        _mutate(rng, shards, i2d, seen)
        if not any(n.lower().endswith(".jpg") and n[0] != "." for sh in shards
                   for n, _ in sh["tar"] or []):   # (a folder of images: the files layout)
            shards[0]["tar"] = (shards[0]["tar"] or []) + [("k9.jpg", IMAGE)]
        _write(root, shards, files)
        try:
            rows, per_unit, books = ingest(cfg, tmp_path)
        except Exception as e:
            raise AssertionError(f"{kind}: seed {SEED} case {case} raised {e!r}") from e
        where = f"{kind}: seed {SEED} case {case}: {shards}"
        want = {u: n for u, n in expected(shards, i2d, files).items() if n or u in per_unit}
        assert per_unit == want, where
        assert books["lost"] == [] and books["records"] == len(rows), (where, books)
        real = [n.partition(".")[0] for sh in shards for n, _ in sh["tar"] or []]
        real += [k for sh in shards for k, s in sh["statuses"] or [] if i2d]
        assert_keys_apart(rows, real)
        seen["rows"] += len(rows)
        seen["invented"] += sum(keys.invented(r[F.KEY.name]) for r in rows)
        seen["real keys that look invented"] += sum(k.startswith("\u2205") for k in real if k)
    print(kind, dict(seen))
    assert seen["invented"] and seen["rows"] > seen["invented"]


def _captions(rng: random.Random, fmt: str) -> tuple[bytes, list]:
    """A captions file whose keys are empty, null (JSONL), missing or look invented."""
    pool = KEYS + ["\u2205:captions.csv:3", "\u2205:captions.jsonl:2", "\u2205\u2205:x"]
    ks = [rng.choice(pool + ([None] if fmt == "jsonl" else [])) for _ in range(rng.randint(1, 6))]
    ks[0] = "k0" if ks[0] == "\u2205k" else ks[0]     # (one record has the key column)
    if fmt == "jsonl":
        lines = [json.dumps({"key": k, "image": "g.jpg", "caption": "c"} if k != "\u2205k"
                            else {"image": "g.jpg", "caption": "no key at all"}) for k in ks]
        return "\n".join(lines).encode() + b"\n", [k for k in ks if k != "\u2205k"]
    lines = ["key,image,caption"] + [f"{k},g.jpg,c" for k in ks]
    return "\n".join(lines).encode() + b"\n", ks


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_keyless_records_never_take_a_real_key(fmt, tmp_path):
    rng = random.Random(f"{SEED}:{fmt}")
    root = tmp_path / "src"
    hostile._image_files(root, [hostile.good("g", 1)])
    cfg = hostile.config(fmt, root)
    seen: Counter = Counter()
    for case in range(CASES):
        data, real = _captions(rng, fmt)
        (root / f"captions.{fmt}").write_bytes(data)
        rows, per_unit, books = ingest(cfg, tmp_path)
        where = f"{fmt}: seed {SEED} case {case}: {data!r}"
        assert len(rows) == data.count(b"\n") - (fmt == "csv"), where      # a row per line
        assert books["lost"] == [], (where, books)
        assert_keys_apart(rows, real)
        ids = [sources.sample_id("src", r[F.KEY.name]) for r in rows]
        repeated = {k for k, n in Counter(r[F.KEY.name] for r in rows).items() if n > 1}
        assert all(not keys.invented(k) for k in repeated), where     # only real keys repeat
        assert len(set(ids)) == len(set(r[F.KEY.name] for r in rows)), where
        seen["rows"] += len(rows)
        seen["invented"] += sum(keys.invented(r[F.KEY.name]) for r in rows)
        seen["real keys that look invented"] += sum(bool(k) and k[0] == "\u2205" for k in real)
    print(fmt, dict(seen))
    assert seen["invented"] and seen["real keys that look invented"]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("gz", [False, True])
def test_the_tar_walk_finds_the_readers_records(fmt, gz, tmp_path):
    """Long names (GNU long-name and PAX headers, ustar prefixes), non-ASCII names, directory
    and link members, concatenated archives, gzip: the census's own header walk finds the same
    records, with the same keys, as the reader."""
    deep = "d" * 60 + "/" + "e" * 60
    names = [f"{deep}/k0.jpg", f"{deep}/k0.txt", "caf\u00e9/k1.jpg", "k1.txt", "k2.jpg"]
    path = tmp_path / ("x.tar.gz" if gz else "x.tar")
    buf = io.BytesIO()
    for part in (names[:3], names[3:]):             # two archives, one after the other
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
            if part[0] == names[3]:
                tf.addfile(tarfile.TarInfo("a-directory/"))
            for n in part:
                info = tarfile.TarInfo(n)
                info.size = 3
                tf.addfile(info, io.BytesIO(b"abc"))
            link = tarfile.TarInfo("k2.json")
            link.type, link.linkname = tarfile.SYMTYPE, "elsewhere"
            tf.addfile(link)
    path.write_bytes(gzip.compress(buf.getvalue()) if gz else buf.getvalue())
    end = tars.TarEnd()
    read = [g.key for g in tars.groups(tars.read(str(path), 1 << 20, end))]
    assert end.error is None
    assert census.tar_keys(path, 1 << 20) == (read, False)
    assert read == [f"{deep}/k0", "caf\u00e9/k1", "k2", "k1", "k2"]
