"""The recaption stage: FFF's pseudo-captions (paper sec. 4.2-4.3). BLIP-2 captions every still-
kept image with beam search and keeps all ``num_return_sequences`` (FFF: 5) captions with their
sequence scores, best first, as extra positives for batch text augmentation.

Degenerate captions (empty, repetitive, duplicate of a better beam, truncated) are kept and
flagged per caption (``recaption_flags``) and counted (``recaption_n_clean``); the stage flags
no row with a reason code, since a bad pseudo-caption says nothing against the image or its
original caption.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import pyarrow as pa

from vlcurate.schemas import F, conform
from vlcurate.schemas import recaption as R
from vlcurate.foundation.params import ModelSpec, Params, at_least, doc, positive
from vlcurate.stages.base import MapStage, Resources, once_per_image

from .captioner import Captioner


@dataclass(frozen=True)
class RecaptionParams(Params):
    """FFF's BLIP-2 pseudo-captions (stage ``recaption``): beam search, every beam kept."""
    model: ModelSpec = doc(ModelSpec(id="Salesforce/blip2-opt-2.7b"), (
        "the captioner (BLIP-2); on a GPU in model.dtype (auto: bf16; float16 also works), on a "
        "CPU in float32"))
    prompt: str = doc("", "the text generation starts from; \"\": plain captioning; e.g. \"a "
                          "photo of\"")
    prompt_in_caption: bool = doc(False, "prepend the prompt to the stored captions")
    num_beams: int = positive(5, doc="beam width (FFF: five captions per image, by beam search)")
    num_return_sequences: int = positive(5, doc="captions kept per image, at most num_beams, "
                                                "best score first")
    max_new_tokens: int = positive(30, doc="the longest caption generated, in tokens")
    length_penalty: float = doc(1.0, "a sequence's score is sum log p / length ** "
                                     "length_penalty")
    repetition_penalty: float = doc(1.0, "generation's repetition penalty; 1.0: off (plain beam "
                                         "search)")
    max_repeats: int = at_least(3, 2, doc="an n-gram (n <= 3) repeated this often back to back "
                                          "marks a caption repetitive")
    batch_size: int = positive(16, doc="images per generate call")
    resources: Resources = Resources()

    def check(self) -> Iterable[tuple[str, str]]:
        if self.num_return_sequences > self.num_beams:
            yield ("num_return_sequences", f"must be <= num_beams ({self.num_beams}), got "
                   f"{self.num_return_sequences}")


class RecaptionStage(MapStage):
    name = "recaption"
    version = "2"                       # every caption of a kept image (per_image)
    per_image = True
    image_homes = True
    Params = RecaptionParams
    inputs = {"ingest": (F.IMAGE,)}
    output = R.RECAPTION
    on_actors = True                    # one BLIP-2 load per actor
    resources = Resources(num_cpus=1, num_gpus=0, batch_size=256)
    model_specs = (("recaption.model", "blip2", "captioner"),)

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        spec = config.recaption.model
        if not spec.random_init:
            return []
        return [(f"recaption: the captioner {spec.id!r} has RANDOM weights (recaption.model."
                 "random_init): its pseudo-captions are noise, for testing only")]

    def setup(self) -> None:
        config = self.config
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
