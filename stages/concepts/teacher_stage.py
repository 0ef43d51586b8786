"""The teacher stage: DiHT's frozen concept teacher (SWAG ViT-H/14 by default) on every still-kept
image, part by part on an actor pool (GPU when ``teacher.resources.num_gpus`` is set), committed
as parts like embed. The ``concepts`` stage then trains its heads on a bounded sample of these
features and computes each part's targets from them: no single process sees every image.

The teacher itself is configured in the ``concepts`` section (``concepts.teacher``,
``concepts.teacher_batch_size``): this stage reads exactly those two fields, so a changed
vocabulary threshold reruns ``concepts`` but never the teacher.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from vlcurate.foundation.params import Params, at_least, doc
from vlcurate.schemas import F, conform
from vlcurate.schemas import concepts as S
from vlcurate.stages.arrow import fixed_lists
from vlcurate.stages.base import MapStage, Resources, once_per_image
from vlcurate.foundation import widths as W

from .teacher import Teacher


@dataclass(frozen=True)
class TeacherParams(Params):
    """DiHT's frozen concept teacher (stage ``teacher``): its features of every kept image."""
    # speed only (the same features); on an H100 one thread held ViT-H/14 to 360 of its 935 img/s
    decode_threads: int = at_least(4, 0, doc=(
        "threads decoding and transforming images inside the actor, ahead of the model (speed "
        "only); 0: on the actor's own thread"))
    resources: Resources = Resources()


class TeacherStage(MapStage):
    name = "teacher"
    version = "2"                         # every caption of a kept image (per_image)
    per_image = True
    image_homes = True
    Params = TeacherParams
    speed_only = ("decode_threads",)
    reads = ("concepts.teacher", "concepts.teacher_batch_size")
    inputs = {"ingest": (F.IMAGE,)}
    on_actors = True                      # one teacher load per actor
    resources = Resources(num_cpus=1, num_gpus=0, batch_size=256)
    model_specs = (("concepts.teacher", "backbone", "teacher"),)

    @classmethod
    def output_schema(cls, upstream: Mapping[str, pa.Schema], config: Any) -> pa.Schema:
        """The width from the teacher's architecture on the meta device (no weights load)."""
        return S.teacher_table(W.teacher_width(config.concepts.teacher))

    def setup(self) -> None:
        self.spec = self.config.concepts.teacher
        self.teacher = Teacher(self.spec)

    def __call__(self, batch: pa.Table) -> pa.Table:
        size = self.config.concepts.teacher_batch_size
        images = batch.column(F.IMAGE.name).to_pylist()
        x = np.stack(once_per_image(images, lambda ims: list(self.teacher.encode(
            ims, size, self.config.teacher.decode_threads)))) \
            if images else np.zeros((0, self.schema.field(S.TEACHER_FEATURES_NAME).type.list_size))
        n = batch.num_rows
        return conform(pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            S.TEACHER_FEATURES_NAME: fixed_lists(x, self.schema.field(S.TEACHER_FEATURES_NAME).type),
            S.CONCEPT_TEACHER.name: pa.array([self.spec.id] * n, pa.string()),
            S.CONCEPT_RANDOM.name: pa.array([self.teacher.loaded.random] * n, pa.bool_()),
            F.REASONS.name: pa.array([[]] * n, F.REASONS.type)}), self.schema)
