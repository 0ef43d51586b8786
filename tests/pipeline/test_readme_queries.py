"""The README's queries, run as written on a real run: they give the counts the manifests give."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from tests.paths import REPO
from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.runner import run


def _block(lang: str, marker: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return next(b for b in blocks if marker in b)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    data = make_demo(tmp / "data", n=40, seed=5)
    cfg = C.load(None, {**demo_overrides(data, tmp / "runs" / "demo" / "run"),
                        "run.progress": False, "source.rows_per_part": 16,
                        "run.stages": ["ids", "lang"]})
    results = run(cfg, executor="local", log=lambda _: None)
    expected = Counter()
    for r in results:
        if r.manifest["stage"] != "export":
            expected.update(r.manifest["reason_counts"])
    assert sum(expected.values()) > 5
    return tmp, expected


def test_pandas_query_counts_each_reason_once(demo_run, monkeypatch):
    cwd, expected = demo_run
    monkeypatch.chdir(cwd)
    code = _block("python", "read_parquet").strip().splitlines()
    scope: dict = {}
    exec("\n".join(code[:-1]), scope)
    counts = eval(code[-1].split("#")[0], scope)
    assert dict(counts) == dict(expected)


def test_duckdb_query_counts_each_flagged_row_once(demo_run, monkeypatch):
    duckdb = pytest.importorskip("duckdb")
    cwd, expected = demo_run
    monkeypatch.chdir(cwd)
    rows = duckdb.sql(_block("sql", "rejects")).fetchall()
    assert Counter({reason: n for _, reason, n in rows}) == expected
    assert [n for *_, n in rows] == sorted((n for *_, n in rows), reverse=True)
