"""Columns of the embed stage (issue 3). Embedding dimensions depend on the models, so the
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


IMAGE_MODEL = pa.field("image_model", pa.string(), metadata={"doc": "image encoder id"})
TEXT_MODEL = pa.field("text_model", pa.string(), metadata={"doc": "caption encoder id"})
RANDOM_WEIGHTS = pa.field("random_weights", pa.bool_(),
                          metadata={"doc": "true when an encoder ran with random weights (tests, demo)"})

# internal, never written: images decoded and resized by the CPU tasks (embed.decode = "tasks")
PIXELS = pa.field("_pixels", pa.binary(), metadata={"doc": "uint8 CHW at the encoder's input size"})
