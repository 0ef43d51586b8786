"""Ingest: read a source, decode and validate every record once, write the samples table."""
from .readers import SourceError, plan, read_part, signature, source_name
from .stage import IngestStage, sample_id

__all__ = ["IngestStage", "SourceError", "plan", "read_part", "sample_id", "signature",
           "source_name"]
