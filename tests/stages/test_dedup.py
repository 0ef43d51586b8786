"""Near-duplicate removal: groups joined by `duplicate` relations keep their first row."""
from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.dataset as ds

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F, tables
from vlcurate.schemas import mining as MI
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import Stage
from vlcurate.stages.dedup import DedupStage, duplicate_groups
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage


def naive_groups(ids: list[str], edges: list[tuple[str, str]]) -> dict[str, str]:
    """Connected components by repeated relabelling; each row -> its component's first row."""
    label = {s: i for i, s in enumerate(ids)}
    changed = True
    while changed:
        changed = False
        for a, b in edges:
            lo = min(label[a], label[b])
            for x in (a, b):
                if label[x] != lo:
                    label[x], changed = lo, True
    return {s: ids[label[s]] for s in ids if ids[label[s]] != s}


def test_groups_equal_a_naive_components_loop():
    rng = random.Random(0)
    for trial in range(30):
        ids = [f"s{i}" for i in range(40)]
        edges = [(rng.choice(ids), rng.choice(ids)) for _ in range(rng.randint(0, 30))]
        edges = [(a, b) for a, b in edges if a != b]
        parts = [ids[:13], ids[13:29], ids[29:]]
        rows = {s: ([], []) for s in ids}
        for a, b in edges:
            rows[a][0].append(b)
            rows[a][1].append(MI.REL_DUPLICATE)
            rows[a][0].append(b)                    # other relations never join rows
            rows[a][1].append(MI.REL_IMAGE)
        rows["s0"][0].append("s39")
        rows["s0"][1].append(MI.REL_TEXT)

        def read(p):
            return pa.table({F.SAMPLE_ID.name: parts[p], F.IMAGE_GROUP.name: parts[p],
                             F.CAPTION.name: parts[p],
                             MI.POSITIVE_IDS.name: [rows[s][0] for s in parts[p]],
                             MI.POSITIVE_RELATIONS.name: [rows[s][1] for s in parts[p]]})
        assert duplicate_groups(read, 3) == naive_groups(ids, edges), trial


def _table(rows: list[tuple]) -> pa.Table:
    """(id, group, caption, duplicate ids) rows -> a positives-like part."""
    return pa.table({F.SAMPLE_ID.name: [r[0] for r in rows], F.IMAGE_GROUP.name: [r[1] for r in rows],
                     F.CAPTION.name: [r[2] for r in rows],
                     MI.POSITIVE_IDS.name: [r[3] for r in rows],
                     MI.POSITIVE_RELATIONS.name: [[MI.REL_DUPLICATE] * len(r[3]) for r in rows]})


def test_other_captions_of_an_image_are_never_duplicates():
    """Image A (five captions), B a near-duplicate image of A (two captions), C shares one
    caption text with A (a text duplicate: C's other caption stays), and a7 repeats a1's pair exactly: dedup drops B's
    rows, C's duplicate row and the repeat, never A's other captions."""
    a = [f"a{i}" for i in range(1, 6)]
    same = {x: [y for y in a if y != x] for x in a}       # S_ii = 1 within an image
    parts = [_table([(x, "A", f"cap {x}", same[x] + (["b1"] if x == "a1" else [])) for x in a]
                    + [("b1", "B", "cap b1", ["a1", "b2"]), ("b2", "B", "cap b2", ["b1", "a2"])]),
             _table([("c1", "C", "cap a3", ["a3"]), ("c2", "C", "other", []),
                     ("a7", "A", "cap a1", ["a1"])])]
    got = duplicate_groups(lambda p: parts[p], 2)
    assert got == {"b1": "a1", "b2": "a2", "c1": "a3", "a7": "a1"}


class PlantedPositives(Stage):
    """Positives with planted duplicate chains across parts: row i ~ row i + 17 for i % 5 == 0."""
    name = "positives"
    inputs = {"ingest": (F.CAPTION,)}
    output = tables.stage_table(MI.POSITIVE_IDS, MI.POSITIVE_RELATIONS)
    wants_position = True
    all_ids: list = []

    def __call__(self, batch):
        ids = batch.column(F.SAMPLE_ID.name).to_pylist()
        pos = [[PlantedPositives.partner(s)] if PlantedPositives.partner(s) else [] for s in ids]
        return pa.table({F.SAMPLE_ID.name: ids, MI.POSITIVE_IDS.name: pos,
                         MI.POSITIVE_RELATIONS.name: [[MI.REL_DUPLICATE] * len(p) for p in pos],
                         F.REASONS.name: [[]] * len(ids), F.REASON_DETAIL.name: [None] * len(ids)},
                        schema=self.output)

    @staticmethod
    def partner(sid):
        ids = PlantedPositives.all_ids
        i = ids.index(sid)
        return ids[i + 17] if i % 5 == 0 and i + 17 < len(ids) else None


def test_the_stage_flags_all_but_the_first_of_each_group(tmp_path):
    data = make_demo(tmp_path / "data", n=40, seed=4)
    cfg = C.load(None, {**demo_overrides(data, tmp_path / "run"), "run.progress": False,
                        "source.rows_per_part": 16})
    dag = [Node(IngestStage), Node(IdsStage, after=("ingest",)),
           Node(PlantedPositives, after=("ids",)), Node(DedupStage, after=("positives",)),
           Node(ExportStage, after=("ingest", "ids", "positives", "dedup"))]
    run(C.load(None, {**demo_overrides(data, tmp_path / "probe"), "run.progress": False,
                      "source.rows_per_part": 16, "run.stages": ["ids"]}), executor="local",
        log=lambda _: None)
    ing = ds.dataset(tmp_path / "probe" / "ids" / "data", format="parquet").to_table()
    PlantedPositives.all_ids = ing.column(F.SAMPLE_ID.name).to_pylist()
    res = {r.manifest["stage"]: r.manifest for r in run(cfg, dag, executor="local",
                                                         log=lambda _: None)}
    t = ds.dataset(tmp_path / "run" / "dedup" / "data", format="parquet").to_table().to_pylist()
    flagged = {r[F.SAMPLE_ID.name]: r[F.REASON_DETAIL.name] for r in t if r[F.REASONS.name]}
    ids = PlantedPositives.all_ids
    flagged_up = set()
    for stage in ("ingest", "ids"):
        tab = ds.dataset(tmp_path / "run" / stage / "data", format="parquet").to_table()
        flagged_up |= {r[F.SAMPLE_ID.name] for r in tab.to_pylist() if r[F.REASONS.name]}
    expect = {ids[i + 17]: f"near-duplicate of {ids[i]}" for i in range(0, len(ids) - 17, 5)
              if not {ids[i], ids[i + 17]} & flagged_up}
    assert flagged == expect and len(flagged) >= 3
    assert res["dedup"]["reason_counts"] == {R.DEDUP_NEAR: len(flagged)}
    assert res["dedup"]["rows_in"] == res["dedup"]["rows_kept"] + res["dedup"]["rows_rejected"]
