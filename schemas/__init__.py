"""Single source of truth for vlcurate's columns (``fields``), reason codes and table schemas."""
from . import fields, reasons, tables
from . import fields as F
from .tables import SchemaError, conform

__all__ = ["F", "fields", "reasons", "tables", "conform", "SchemaError"]
