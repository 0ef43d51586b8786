"""The ids step hash-partitioned over tasks equals the naive one-pass reference
(first occurrence kept), on planted duplicates across parts, with a local or an S3 scratch."""
import random

import numpy as np
import pyarrow as pa
import pytest

from vlcurate.schemas import F
from vlcurate.stages.ids import bucket_of, distributed_duplicates, find_duplicates


class Parts:
    """A global step's ``read`` over in-memory parts: ``read(part)``, a sequential ``map`` and a
    ``scratch`` folder (what ``executors.tasks.Upstream`` gives a step under the local
    executor)."""

    def __init__(self, parts: list[list[str]], scratch: str) -> None:
        self.parts, self.scratch, self.calls = parts, scratch, 0

    def __call__(self, p: int) -> pa.Table:
        return pa.table({F.SAMPLE_ID.name: self.parts[p],
                         F.ROW.name: pa.array(np.arange(len(self.parts[p])), pa.int64())})

    def map(self, fn, items):
        self.calls += 1
        return [fn(x) for x in items]


def planted(seed: int, n_parts: int = 7) -> list[list[str]]:
    rng = random.Random(seed)
    pool = [f"{rng.getrandbits(64):016x}" for _ in range(60)]   # ids repeat within and across
    return [[rng.choice(pool) for _ in range(rng.randint(0, 25))] for _ in range(n_parts)]


@pytest.mark.parametrize("seed", range(6))
def test_distributed_equals_naive_on_planted_duplicates(seed, tmp_path):
    parts = planted(seed)
    read = Parts(parts, str(tmp_path / "scratch"))
    naive = find_duplicates(read, len(parts))
    assert naive, "the plant has duplicates"
    assert any(p0 != p for p, rows in naive.items() for d in rows.values()
               for p0 in [int(d.split("part ")[1].split()[0])]), "some across parts"
    for buckets in (None, 1, 3, 7):      # None: sized from part 0 (one bucket here)
        assert distributed_duplicates(read, len(parts), read.scratch, buckets) == naive
    assert read.calls == 8 and not (tmp_path / "scratch").exists()   # scratch removed after


def test_on_an_s3_scratch(s3):
    parts = planted(11)
    read = Parts(parts, s3.bucket() + "/run/ids/_tmp/prepare/ids")
    assert distributed_duplicates(read, len(parts), read.scratch, 4) == \
        find_duplicates(read, len(parts))


def test_buckets_are_stable_and_spread():
    ids = [f"{i:016x}" for i in range(2000)]
    b = bucket_of(ids, 8)
    assert (b == bucket_of(ids, 8)).all() and set(b.tolist()) == set(range(8))
    assert np.bincount(b).min() > 150
