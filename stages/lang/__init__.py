from .stage import LangStage

__all__ = ["LangStage"]
