"""Recaption: FFF's BLIP-2 five-beam pseudo-captions with their sequence scores."""
from .captioner import Beam, Captioner, degenerate
from .stage import RecaptionStage

__all__ = ["Beam", "Captioner", "RecaptionStage", "degenerate"]
