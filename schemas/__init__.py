"""Single source of truth for vlcurate's columns (``fields`` and one module per stage family),
reason codes and table schemas."""
from . import cat, concepts, embed, fields, lang, mining, reasons, recaption, tables
from . import fields as F
from .tables import SchemaError, conform

# every declared table schema, by name (tests/golden holds one str(schema) file per entry)
ALL_TABLES = {**tables.ALL, **mining.ALL, **cat.ALL, **recaption.ALL, **concepts.ALL,
              **lang.ALL}

__all__ = ["F", "fields", "reasons", "tables", "embed", "mining", "cat", "recaption", "concepts",
           "lang", "conform", "SchemaError", "ALL_TABLES"]
