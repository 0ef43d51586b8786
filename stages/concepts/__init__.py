"""Concepts: DiHT's concept-distillation targets (WordNet vocabulary, frozen teacher, linear
heads, top-k soft targets per image)."""
from .stage import ConceptsStage

__all__ = ["ConceptsStage"]
