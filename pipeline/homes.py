"""Per-image work once per distinct image across parts: the image's home.

A per-image stage (OCR, image embedding, teacher, recaptions) computes each distinct image of a
call once (``stages/images.py``). An image whose rows lie in several parts (a shuffled source:
img2dataset downloads one file per caption row) would be computed in each. Before such a stage:

1. **plan** (``plan``; one read of ``image_group`` and the flag levels per part, in parallel):
   the groups each part computes (``parts.group_rows``); a group computed in more than one part
   *spans* parts, and its home is the first of them. The plan of each part is written beside
   the stage's tables (``_homes/plan/``): the spanning groups it is home to, with the parts that
   need each.
2. **home pass**: the stage runs on each home part with only its home groups' rows active,
   records what it computed (``stages.images.image_pass``) and writes each result to every part
   that needs it (``_homes/values/to-<part>/``). Its commits (``_homes/_commit``) make it
   resumable like any stage; its tables hold sample ids only.
3. **the stage's pass**, as without homes, except that each row of a spanning group carries its
   image's result (``F.IMAGE_VALUE``) and the stage replays it instead of computing.

The result of a spanning image therefore comes from one computation wherever its rows are, the
same for any batch size, executor or concurrency (the home pass's chunks are the home part's,
as every chunk is). Memory: the plan holds one entry per distinct image on the driver (about
100 bytes: 1M images, 100 MB); a part's replayed values are read by that part alone.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.foundation import storage
from vlcurate.schemas import F

MARK = "spanning.json"      # the last plan's count of spanning groups (runner.to_redo reads it)


@dataclass(frozen=True)
class ImagesIO:
    """The image pass a ``PartIO`` reads for: ``home`` (the home pass) or ``replay``."""
    mode: str
    root: str


def plan_uri(root: str, part: int) -> str:
    return storage.join(root, "plan", f"part-{part:05d}.pkl")


def values_dir(root: str, part: int) -> str:
    return storage.join(root, "values", f"to-{part:05d}")


def plan(groups_of: Callable[[int], list[str]], n_parts: int, map_fn: Callable, root: str
         ) -> tuple[int, int]:
    """Write each part's plan from the groups each part computes (``groups_of``, through
    ``map_fn``: Ray tasks); (distinct groups computed, groups that span parts)."""
    parts_of: dict[str, list[int]] = {}
    for part, groups in enumerate(map_fn(groups_of, list(range(n_parts)))):
        for g in groups:
            parts_of.setdefault(g, []).append(part)
    homes: list[dict[str, list[int]]] = [{} for _ in range(n_parts)]
    spanning = 0
    for g, parts in parts_of.items():
        if len(parts) > 1:
            homes[parts[0]][g] = parts
            spanning += 1
    storage.delete(storage.join(root, "plan"))
    for part, home in enumerate(homes):
        if home:
            storage.write_bytes(plan_uri(root, part), pickle.dumps(home))
    storage.write_json(storage.join(root, MARK), {"spanning": spanning})
    return len(parts_of), spanning


def home_parts(root: str, n_parts: int) -> list[int]:
    return [p for p in range(n_parts) if storage.exists(plan_uri(root, p))]


def spanned(root: str) -> bool:
    """Whether the last plan beside the stage found groups spanning parts."""
    return bool((storage.read_json(storage.join(root, MARK)) or {}).get("spanning"))


def _home_of(root: str, part: int) -> dict:
    uri = plan_uri(root, part)
    return pickle.loads(storage.read_bytes(uri)) if storage.exists(uri) else {}


def attach(io: Any, part: int, t: pa.Table, groups: list) -> pa.Table:
    """A part's rows as the image pass reads them: in the home pass, only its home groups'
    rows active, each with its group (``F.IMAGE_HOME``); in the stage's pass, the replayed
    result of each row of a spanning group (``F.IMAGE_VALUE``)."""
    active = t.column(F.ACTIVE.name).to_numpy(zero_copy_only=False)
    if io.images.mode == "home":
        home = _home_of(io.images.root, part)
        mine = active & np.array([g in home for g in groups], bool)
        for fld in (F.ACTIVE, F.WANTED):
            t = t.set_column(t.schema.get_field_index(fld.name), fld, pa.array(mine))
        return t.append_column(F.IMAGE_HOME, pa.array(
            [g if m else None for g, m in zip(groups, mine)], F.IMAGE_HOME.type))
    values = replayed(io.images.root, part)
    return t.append_column(F.IMAGE_VALUE, pa.array(
        [values.get(g) if a else None for g, a in zip(groups, active)], F.IMAGE_VALUE.type))


def replayed(root: str, part: int) -> dict[str, bytes]:
    """{group: pickled result} written to ``part`` by the home pass; a group computed in two
    chunks of its home part takes the first chunk's (files in (part, row) order)."""
    out: dict[str, bytes] = {}
    where = values_dir(root, part)
    for name in sorted(i.base_name for i in storage.listdir(where)):
        t = pq.read_table(pa.BufferReader(storage.read_bytes(storage.join(where, name))))
        for g, v in zip(t.column(F.IMAGE_GROUP.name).to_pylist(),
                        t.column(F.IMAGE_VALUE.name).to_pylist()):
            out.setdefault(g, v)
    return out


def spill(frag: pa.Table, root: str, part: int, first_row: int) -> pa.Table:
    """Write each result the home pass's fragment recorded to every part whose rows show the
    image."""
    groups = frag.column(F.IMAGE_HOME.name).to_pylist()
    values = frag.column(F.IMAGE_VALUE.name).to_pylist()
    home = _home_of(root, part)
    to: dict[int, dict[str, bytes]] = {}
    for g, v in zip(groups, values):
        if g is not None and v is not None:
            for q in home[g]:
                to.setdefault(q, {}).setdefault(g, v)
    for q, vals in sorted(to.items()):
        t = pa.table({F.IMAGE_GROUP.name: pa.array(list(vals), pa.string()),
                      F.IMAGE_VALUE.name: pa.array(list(vals.values()), F.IMAGE_VALUE.type)})
        sink = pa.BufferOutputStream()
        pq.write_table(t, sink)
        storage.write_bytes(storage.join(values_dir(root, q),
                                         f"from-{part:05d}-{first_row:09d}.parquet"),
                            sink.getvalue().to_pybytes())
    return frag


def values_of(home: pa.ChunkedArray, active: np.ndarray, ctx: Any) -> pa.Array:
    """The home pass's output column: each home group's results (pickled, one per
    ``once_per_image`` call of the stage) on the first row of the chunk that shows it."""
    seen: set = set()
    out: list[Optional[bytes]] = []
    i = -1
    for g, a in zip(home.to_pylist(), active):
        i += bool(a)
        values = ctx.row_values(i) if a and g is not None and g not in seen else None
        if values is not None:
            seen.add(g)
        out.append(None if values is None else pickle.dumps(values, protocol=5))
    return pa.array(out, F.IMAGE_VALUE.type)


def replay_of(batch: pa.Table, active: np.ndarray) -> Optional[list]:
    """Per row the stage sees (the ``active`` ones), its image's results from its home, or
    None."""
    column = batch.column(F.IMAGE_VALUE.name)
    if column.null_count == len(column):
        return None
    loaded: dict[bytes, tuple] = {}
    out: list[Optional[tuple]] = []
    for v, a in zip(column.to_pylist(), active):
        if a:
            if v is not None and v not in loaded:
                loaded[v] = pickle.loads(v)
            out.append(None if v is None else loaded[v])
    return out
