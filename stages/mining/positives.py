"""Stage ``positives``: the positives table (FFF Eq. 1 false negatives + HELIP duplicates).

Why a stage of its own, after ``hpm``, rather than more columns of ``hpm``:

* it runs after noise removal, so (with ``hpm.noise_action: drop``) noise pairs are neither
  given positives nor named as anyone's positive: the trainer's multi-positive labels only
  point at rows that survived;
* its search is different: positives need one high unimodal (or cross-modal) similarity, so
  they are near neighbours *per modality*, which the joint HPM index does not find;
* its table is exactly the positives table (sample_id, ids, relations, scores), which the
  trainer reads on its own; changing an FFF threshold reruns this stage, not HPM.

The method (exact blockwise or per-modality IVF-PQ), device, seed and the duplicate threshold
come from the ``hpm`` section, so the two stages agree on what a duplicate is.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.stages.base import Resources, Stage, reasons_array

from . import fff, hpm
from .stage import EMBED, set_threads, use_fast
from .store import Store, collect, lists, with_nulls

CROSS = (M.CROSS_IMAGE_EMB_NAME, M.CROSS_TEXT_EMB_NAME)


def columns(config: Any) -> tuple[str, ...]:
    return (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME) + (CROSS if config.positives.cross_modal else ())


def rule(config: Any) -> fff.Rule:
    p = config.positives
    return fff.Rule(p1=p.p1, p1_text=p.p1_text, p2=p.p2, p3=p.p3, dup=config.hpm.dup_threshold,
                    cross=p.cross_modal, duplicates=p.duplicates)


class PositivesStage(Stage):
    name = "positives"
    version = "1"
    config_sections = ("positives", "hpm")
    inputs = {EMBED: ()}
    output = M.POSITIVES
    resources = Resources(num_cpus=1, batch_size=0)
    heavy_init = True
    wants_position = True

    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], config: Any) -> list[str]:
        out = [E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME] if upstream == EMBED else []
        if config.positives.cross_modal and schema is not None:   # from whichever stage has them
            out += [c for c in CROSS if c in schema.names]
        return out

    @staticmethod
    def prepare(config: Any, read: Callable[[int], pa.Table], n_parts: int, workdir: str) -> dict:
        h = config.hpm
        set_threads(h.build_threads)
        meta = collect(read, n_parts, workdir, columns(config))
        state: dict = {"store": meta, "fast": use_fast(h, meta.n) and meta.n > 1, "indexes": {}}
        if state["fast"]:
            vec = Store(meta).vec
            names = {"image": E.IMAGE_EMB_NAME, "text": E.TEXT_EMB_NAME}
            if config.positives.cross_modal:
                names["cross"] = M.CROSS_TEXT_EMB_NAME
            for key, col in names.items():
                p = hpm.auto_params(meta.n, vec[col].shape[1], nbits=h.pq_nbits,
                                    nprobe=config.positives.nprobe)
                path = os.path.join(workdir, f"{key}.ivfpq")
                hpm.save_index(hpm.build_ivfpq(vec[col], p, h.seed), path)
                state["indexes"][key] = (path, p.nprobe)
        return state

    def __init__(self, config: Any, state: Any = None) -> None:
        super().__init__(config, state)
        self.device = hpm.resolve_device(config.hpm.device)
        self.rule = rule(config)
        self.store = Store(state["store"])
        v = self.store.vec
        cross = [v[c] for c in CROSS] if self.rule.cross else [None, None]
        self.vectors = (v[E.IMAGE_EMB_NAME], v[E.TEXT_EMB_NAME], *cross)
        self.fast = None
        if not state["fast"]:        # the base on the device once (on the CPU: the memmaps)
            self.base = [None if v is None else hpm.as_tensor(v, self.device) for v in self.vectors]
        else:
            indexes = {k: hpm.load_index(path, nprobe, self.device)
                       for k, (path, nprobe) in state["indexes"].items()}
            self.fast = fff.FastPositives(indexes, *self.vectors, device=self.device)

    def find(self, gidx: np.ndarray) -> fff.Positives:
        p, h = self.config.positives, self.config.hpm
        if self.fast is not None:
            return self.fast.query(gidx, self.rule, p.max_positives, p.k_prime)
        return fff.exact_positives(*self.base[:2], self.rule, p.max_positives, gidx,
                                   *self.base[2:], h.block_size, h.query_block, self.device)

    def __call__(self, batch: pa.Table) -> pa.Table:
        gidx = self.store.locate(batch.column(F.PART.name).to_numpy(),
                                 batch.column(F.ROW.name).to_numpy())
        present = gidx >= 0
        r = self.find(gidx[present])
        ok = r.idx >= 0
        rel = np.array(fff.CODES, dtype=object)[np.where(ok, r.code, 0)]
        return pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            M.POSITIVE_IDS.name: with_nulls(self.store.id_lists(r.idx), present),
            M.POSITIVE_RELATIONS.name: with_nulls(lists(rel, ok, pa.string()), present),
            M.POSITIVE_SCORES.name: with_nulls(lists(r.score, ok, pa.float32()), present),
            F.REASONS.name: reasons_array([[] for _ in range(batch.num_rows)]),
            F.REASON_DETAIL.name: pa.array([None] * batch.num_rows, pa.string()),
        }, schema=self.output)
