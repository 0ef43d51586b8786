"""Concepts: DiHT's concept-distillation targets (WordNet vocabulary, frozen teacher, linear
heads, top-k soft targets per image)."""
from .stage import ConceptsStage
from .teacher_stage import TeacherStage

__all__ = ["ConceptsStage", "TeacherStage"]
