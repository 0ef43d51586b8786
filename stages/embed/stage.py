"""The embed stage: HELIP's unimodal embeddings of every still-kept pair (paper sec. 4.1: DINO
ViT-S/8 for images, a SentenceTransformer for captions), L2-normalised, for hard-pair mining;
and, when ``embed.cross_model`` is set, FFF's cross-modal (CLIP-style) image and caption
embeddings, for the positives' S_it, S_ii and S_tt (FFF sec. 4.1)."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import numpy as np
import pyarrow as pa

from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import embed as E
from vlcurate.foundation import models
from vlcurate.foundation.params import ModelSpec, Params, doc, positive
from vlcurate.stages.arrow import fixed_lists
from vlcurate.stages.base import MapStage, Resources, once_per_image

from vlcurate.foundation import widths as W
from .encoders import CrossEncoder, ImageEncoder, ImagePreprocessor, TextEncoder


@functools.lru_cache(maxsize=4)
def _preprocessor(spec: Any) -> ImagePreprocessor:
    return ImagePreprocessor(spec)


def random_note(stage: str, key: str, spec: Any, what: str) -> str:
    return (f"{stage}: the {key.split('.')[-1].replace('_', ' ')} {spec.id!r} has RANDOM weights "
            f"({key}.random_init): {what} are for testing only")


@dataclass(frozen=True)
class EmbedParams(Params):
    """HELIP's unimodal encoders: DINO ViT-S/8 (CLS token) and a SentenceTransformer."""
    image_model: ModelSpec = doc(ModelSpec(id="vit_small_patch8_224.dino"), (
        "HELIP's image encoder (its CLS token, L2-normalised)"))
    text_model: ModelSpec = doc(ModelSpec(id="sentence-transformers/all-mpnet-base-v2"), (
        "HELIP's text encoder (a SentenceTransformer)"))
    cross_model: Optional[ModelSpec] = doc(None, (
        "FFF sec. 4.1: an image-text model for S_it, X_ii, X_tt and cross_score: a CLIPModel "
        "({id: openai/clip-vit-large-patch14}) or a vlcurate finetune output ({path: "
        "<its out_dir>}); null: none (positives lacks Eq. 1's main clause)"))
    cross_batch_size: int = positive(64, doc="images or captions per cross-model forward pass "
                                             "(a fixed shape)")
    image_batch_size: int = positive(64, doc="images per image-encoder forward pass")
    text_batch_size: int = positive(256, doc="captions per text-encoder forward pass")
    float16_storage: bool = doc(False, "store the embeddings as float16 (half the bytes)")
    decode: Literal["threads", "tasks"] = doc("threads", (
        "decode and preprocess images in threads inside the encoder actor, overlapping the "
        "model, or in the CPU tasks that read each part, ahead of the actor"))
    decode_threads: int = positive(4, doc="decode: threads, the threads per actor")
    resources: Resources = Resources()


class EmbedStage(MapStage):
    name = "embed"
    version = "4"                     # the cross-modal score column
    per_image = True
    image_homes = True
    Params = EmbedParams
    speed_only = ("decode", "decode_threads")   # where / how many threads decode (same pixels)
    inputs = {"ingest": (F.IMAGE, F.CAPTION)}
    on_actors = True                  # one model load per actor, never per batch
    resources = Resources(num_cpus=1, num_gpus=0, batch_size=1024)
    model_specs = (("embed.image_model", "timm", "image encoder"),
                   ("embed.text_model", "sentence_transformer", "caption encoder"),
                   ("embed.cross_model", "clip", "cross-modal encoder"))

    @classmethod
    def output_schema(cls, upstream: Mapping[str, pa.Schema], config: Any) -> pa.Schema:
        """Widths come from the models' configurations (``widths.py``: no weights are loaded on
        the driver); missing weights fail here, before any actor starts."""
        c = config.embed
        cross = [] if c.cross_model is None else [
            E.cross_image_emb(W.cross_width(c.cross_model), c.float16_storage),
            E.cross_text_emb(W.cross_width(c.cross_model), c.float16_storage), E.CROSS_MODEL,
            E.CROSS_SCORE]
        return tables.stage_table(E.image_emb(W.image_width(c.image_model), c.float16_storage),
                                  E.text_emb(W.text_width(c.text_model), c.float16_storage),
                                  E.IMAGE_MODEL, E.TEXT_MODEL, *cross, E.RANDOM_WEIGHTS)

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        c = config.embed
        out = [f"embed: the {kind} encoder {spec.id!r} has RANDOM weights (embed.{kind}_model."
               "random_init): its embeddings, and the hard pairs mined from them, are for "
               "testing only" for kind, spec in (("image", c.image_model), ("text", c.text_model))
               if spec.random_init]
        if c.cross_model is not None and c.cross_model.random_init:
            out.append(random_note("embed", "embed.cross_model", c.cross_model,
                                   "its embeddings, and the FFF positives found with them,"))
        return out

    @classmethod
    def environment(cls, config: Any) -> dict:
        """A finetune output as the cross-modal encoder: its weights' digest (a retrained model
        in the same folder reruns the stage)."""
        spec = config.embed.cross_model
        folder = None if spec is None else models.finetune_dir(spec)
        if folder is None:
            return {}
        from vlcurate.foundation import storage
        info = storage.read_json(storage.join(folder, models.FINETUNE_JSON)) or {}
        data = storage.read_bytes(storage.join(folder, info.get("weights", "encoder.pt")))
        return {"cross_model_weights": hashlib.sha256(data).hexdigest()[:16]}

    @classmethod
    def preprocess(cls, config: Any, batch: pa.Table) -> pa.Table:
        """With ``embed.decode: tasks``, the CPU tasks that read a part decode and resize its
        images (the model's own transform), so the encoder actors only normalise and encode."""
        if config.embed.decode != "tasks" or F.IMAGE.name not in batch.column_names:
            return batch
        pre = _preprocessor(config.embed.image_model)
        active = batch.column(F.ACTIVE.name).to_pylist() \
            if F.ACTIVE.name in batch.column_names else None
        pixels = [pre.pixels(b).tobytes() if b is not None and (active is None or active[i])
                  else None for i, b in enumerate(batch.column(F.IMAGE.name).to_pylist())]
        if config.embed.cross_model is not None:    # the cross-modal encoder decodes its own
            return batch.append_column(E.PIXELS, pa.array(pixels, pa.binary()))
        i = batch.schema.get_field_index(F.IMAGE.name)
        return batch.set_column(i, E.PIXELS, pa.array(pixels, pa.binary()))

    def setup(self) -> None:
        config = self.config
        c = self.cfg = config.embed
        self.images = ImageEncoder(c.image_model)
        self.texts = TextEncoder(c.text_model)
        self.cross = None if c.cross_model is None else CrossEncoder(c.cross_model)
        self.random = self.images.loaded.random or self.texts.loaded.random or \
            (self.cross is not None and self.cross.random)

    def __call__(self, batch: pa.Table) -> pa.Table:
        c = self.cfg
        text = self.texts.encode(batch.column(F.CAPTION.name).to_pylist(), c.text_batch_size)
        image = self.image_vectors(batch)
        n = batch.num_rows
        cols = {F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                E.IMAGE_EMB_NAME: fixed_lists(image, self.schema.field(E.IMAGE_EMB_NAME).type),
                E.TEXT_EMB_NAME: fixed_lists(text, self.schema.field(E.TEXT_EMB_NAME).type),
                E.IMAGE_MODEL.name: pa.array([c.image_model.id] * n, pa.string()),
                E.TEXT_MODEL.name: pa.array([c.text_model.id] * n, pa.string()),
                E.RANDOM_WEIGHTS.name: pa.array([self.random] * n, pa.bool_()),
                F.REASONS.name: pa.array([[]] * n, F.REASONS.type)}
        if self.cross is not None:
            cols.update(self.cross_columns(batch))
        return conform(pa.table(cols), self.schema)

    def image_vectors(self, batch: pa.Table) -> np.ndarray:
        """One embedding per row, each distinct image encoded once (COCO and Flickr show an
        image with five captions): the rows of a chunk are grouped by their image's bytes, in
        order of first appearance, so the result depends only on the chunk."""
        c = self.cfg
        if E.PIXELS.name not in batch.column_names:
            return _per_row(batch.column(F.IMAGE.name).to_pylist(), lambda ims: self.images.encode(
                ims, c.image_batch_size, threads=c.decode_threads), self.images.dim)
        shape = (3, *self.images.pre.input_size[1:])
        return _per_row(batch.column(E.PIXELS.name).to_pylist(), lambda px: self.images
                        .encode_preprocessed(np.stack([np.frombuffer(b, np.uint8).reshape(shape)
                                                       for b in px]), c.image_batch_size),
                        self.images.dim)

    def cross_columns(self, batch: pa.Table) -> dict:
        """FFF's cross-modal image and caption embeddings of the batch."""
        c, n = self.cfg, batch.num_rows
        image = _per_row(batch.column(F.IMAGE.name).to_pylist(), lambda ims: self.cross
                         .encode_images(ims, c.cross_batch_size), self.cross.dim)
        text = self.cross.encode_texts(batch.column(F.CAPTION.name).to_pylist(),
                                       c.cross_batch_size)
        name = c.cross_model.id or c.cross_model.path
        return {E.CROSS_IMAGE_EMB_NAME: fixed_lists(
                    image, self.schema.field(E.CROSS_IMAGE_EMB_NAME).type),
                E.CROSS_TEXT_EMB_NAME: fixed_lists(
                    text, self.schema.field(E.CROSS_TEXT_EMB_NAME).type),
                E.CROSS_MODEL.name: pa.array([name] * n, pa.string()),
                E.CROSS_SCORE.name: pa.array(pair_scores(image, text), pa.float32())}


def pair_scores(image: np.ndarray, text: np.ndarray) -> np.ndarray:
    """Each row's cosine of its image and caption vectors (both L2-normalised), float32, summed
    in a fixed order (the row's own values only: no batch changes it)."""
    return np.einsum("ij,ij->i", image.astype(np.float32), text.astype(np.float32))


def _per_row(images: list, encode: Any, dim: int) -> np.ndarray:
    """``encode`` (a list of distinct images -> an (m, dim) array) fanned out to every row."""
    if not images:
        return np.zeros((0, dim), np.float32)
    return np.stack(once_per_image(images, lambda distinct: list(encode(distinct))))
