"""Embed: HELIP's unimodal image (timm DINO ViT) and caption (SentenceTransformer) embeddings,
and FFF's cross-modal (CLIP-style) ones, of captions and (stage ``recaption_embed``) recaptions."""
from .encoders import CrossEncoder, ImageEncoder, ImagePreprocessor, TextEncoder
from .recaption_embed_stage import RecaptionEmbedStage
from .stage import EmbedStage

__all__ = ["EmbedStage", "RecaptionEmbedStage", "CrossEncoder", "ImageEncoder",
           "ImagePreprocessor", "TextEncoder"]
