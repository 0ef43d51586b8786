"""Columns of the embed stage. Embedding dimensions depend on the models, so the
embedding fields are built by functions; their names are fixed here."""
from __future__ import annotations

import pyarrow as pa

from .fields import embedding

IMAGE_EMB_NAME = "image_emb"   # L2-normalised image embedding (DINO ViT CLS token)
TEXT_EMB_NAME = "text_emb"     # L2-normalised caption embedding (SentenceTransformer)


def image_emb(dim: int, float16: bool = False) -> pa.Field:
    return embedding(IMAGE_EMB_NAME, dim, float16=float16)


def text_emb(dim: int, float16: bool = False) -> pa.Field:
    return embedding(TEXT_EMB_NAME, dim, float16=float16)


# FFF's cross-modal (CLIP-style) embeddings, written only when embed.cross_model is set: the
# projected, L2-normalised image and caption features of one image-text model (S_it, S_ii, S_tt)
CROSS_IMAGE_EMB_NAME = "cross_image_emb"
CROSS_TEXT_EMB_NAME = "cross_text_emb"


def cross_image_emb(dim: int, float16: bool = False) -> pa.Field:
    return embedding(CROSS_IMAGE_EMB_NAME, dim, float16=float16)


def cross_text_emb(dim: int, float16: bool = False) -> pa.Field:
    return embedding(CROSS_TEXT_EMB_NAME, dim, float16=float16)


CROSS_MODEL = pa.field("cross_model", pa.string(), metadata={"doc": "cross-modal encoder id"})
CROSS_SCORE = pa.field("cross_score", pa.float32(), metadata={"doc": (
    "the pair's cosine under the cross-modal encoder (DataComp's CLIP score; the filter of "
    "export.min_score)")})

# the export policy's cut on cross_score (export.min_score): below it, or no score at all
REASON_CODES = {"LOW_CROSS_SCORE": "export.low_cross_score"}

# stage ``recaption_embed``: FFF sec. 4.3's extra captions in the same cross-modal text space
RECAPTION_CROSS_EMB_NAME = "recaption_cross_emb"


def recaption_cross_emb(dim: int, float16: bool = False) -> pa.Field:
    return pa.field(RECAPTION_CROSS_EMB_NAME, pa.list_(embedding("item", dim, float16=float16).type),
                    metadata={"doc": "cross-modal text embedding of each recaption (same order as "
                                     "recaptions); null when the row was not recaptioned"})


IMAGE_MODEL = pa.field("image_model", pa.string(), metadata={"doc": "image encoder id"})
TEXT_MODEL = pa.field("text_model", pa.string(), metadata={"doc": "caption encoder id"})
RANDOM_WEIGHTS = pa.field("random_weights", pa.bool_(),
                          metadata={"doc": "true when an encoder ran with random weights (tests, demo)"})

# internal, never written: images decoded and resized by the CPU tasks (embed.decode = "tasks")
PIXELS = pa.field("_pixels", pa.binary(), metadata={"doc": "uint8 CHW at the encoder's input size"})
