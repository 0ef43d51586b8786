"""The recaption stage: FFF's pseudo-captions (paper sec. 4.2-4.3). BLIP-2 captions every still-
kept image with beam search and keeps all ``num_return_sequences`` (FFF: 5) captions with their
sequence scores, best first, as extra positives for batch text augmentation.

Degenerate captions (empty, repetitive, duplicate of a better beam, truncated) are kept and
flagged per caption (``recaption_flags``) and counted (``recaption_n_clean``); the stage flags
no row with a reason code, since a bad pseudo-caption says nothing against the image or its
original caption.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from vlcurate.schemas import F, conform
from vlcurate.schemas import recaption as R
from vlcurate.stages.base import Resources, Stage, once_per_image

from .captioner import Captioner


class RecaptionStage(Stage):
    name = "recaption"
    version = "1"
    config_sections = ("recaption",)
    inputs = {"ingest": (F.IMAGE,)}
    output = R.RECAPTION
    heavy_init = True                   # one BLIP-2 load per actor
    resources = Resources(num_cpus=1, num_gpus=0, batch_size=256)

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        spec = config.recaption.model
        if not spec.random_init:
            return []
        return [(f"recaption: the captioner {spec.id!r} has RANDOM weights (recaption.model."
                 "random_init): its pseudo-captions are noise, for testing only")]

    def __init__(self, config: Any, state: Any = None) -> None:
        super().__init__(config, state)
        self.cfg = config.recaption
        self.captioner = Captioner(self.cfg)

    def __call__(self, batch: pa.Table) -> pa.Table:
        beams = once_per_image(batch.column(F.IMAGE.name).to_pylist(),
                               lambda ims: self.captioner.caption_bytes(ims, self.cfg.batch_size))
        n = batch.num_rows
        return conform(pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            R.RECAPTIONS.name: pa.array([[b.text for b in bs] for bs in beams], R.RECAPTIONS.type),
            R.RECAPTION_SCORES.name: pa.array([[b.score for b in bs] for bs in beams],
                                              R.RECAPTION_SCORES.type),
            R.RECAPTION_FLAGS.name: pa.array([[b.flag for b in bs] for bs in beams],
                                             R.RECAPTION_FLAGS.type),
            R.RECAPTION_N_CLEAN.name: pa.array([sum(b.flag is None for b in bs) for bs in beams],
                                               R.RECAPTION_N_CLEAN.type),
            R.RECAPTION_MODEL.name: pa.array([self.cfg.model.id] * n, pa.string()),
            R.RECAPTION_RANDOM.name: pa.array([self.captioner.loaded.random] * n, pa.bool_()),
            F.REASONS.name: pa.array([[]] * n, F.REASONS.type)}), self.output)
