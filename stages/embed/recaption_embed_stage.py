"""Stage ``recaption_embed``: FFF sec. 4.3's extra captions in the cross-modal text space.

FFF assigns positives over images x k captions (the caption plus its pseudo-captions), with S_it
per caption and S_tt between caption groups, all from one image-text model. The embed stage has
the caption's cross-modal embedding; this stage adds one per recaption, with the same model
(``embed.cross_model``, hence the ``embed`` section), so the positives stage can run sec. 4.3.
Without a cross-modal model it writes no embedding column and loads nothing (the positives stage
then runs the unimodal rule, and says so). Rows without recaptions get nulls.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import embed as E
from vlcurate.schemas import recaption as R
from vlcurate.stages.arrow import fixed_lists, list_array
from vlcurate.stages.base import MapStage, Resources

from .encoders import CrossEncoder
from vlcurate.foundation.widths import cross_width


class RecaptionEmbedStage(MapStage):
    name = "recaption_embed"
    version = "2"                     # every caption of a kept image (per_image)
    per_image = True
    reads = ("embed",)               # the cross-modal model of embed.cross_model
    inputs = {"recaption": (R.RECAPTIONS,)}
    on_actors = True                  # one cross-model load per actor
    resources = Resources(num_cpus=1, num_gpus=0, batch_size=1024)

    @classmethod
    def output_schema(cls, upstream: Mapping[str, pa.Schema], config: Any) -> pa.Schema:
        c = config.embed
        if c.cross_model is None:
            return tables.stage_table()
        return tables.stage_table(E.recaption_cross_emb(cross_width(c.cross_model),
                                                        c.float16_storage))

    def setup(self) -> None:
        config = self.config
        self.cfg = config.embed
        self.cross = None if self.cfg.cross_model is None else CrossEncoder(self.cfg.cross_model)

    def __call__(self, batch: pa.Table) -> pa.Table:
        n = batch.num_rows
        cols = {F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                F.REASONS.name: pa.array([[]] * n, F.REASONS.type)}
        if self.cross is not None:
            cols[E.RECAPTION_CROSS_EMB_NAME] = self.embed(batch.column(R.RECAPTIONS.name))
        return conform(pa.table(cols), self.schema)

    def embed(self, recaptions: Any) -> pa.Array:
        """list<string> per row -> list<embedding> per row (null stays null), one encoder pass
        over every recaption of the batch."""
        rows = recaptions.to_pylist()
        flat = [t for r in rows if r for t in r]
        vec = self.cross.encode_texts(flat, self.cfg.cross_batch_size)
        item = self.schema.field(E.RECAPTION_CROSS_EMB_NAME).type.value_type
        values = fixed_lists(vec, item) if len(flat) else pa.array([], item)
        sizes = np.array([len(r) if r is not None else 0 for r in rows], np.int32)
        return list_array(sizes, values, mask=pa.array([r is None for r in rows], pa.bool_()))
