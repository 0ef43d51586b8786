"""Embed: HELIP's unimodal image (timm DINO ViT) and caption (SentenceTransformer) embeddings."""
from .encoders import ImageEncoder, ImagePreprocessor, TextEncoder
from .stage import EmbedStage

__all__ = ["EmbedStage", "ImageEncoder", "ImagePreprocessor", "TextEncoder"]
