"""Single source of truth for vlcurate's columns (``fields`` and one module per stage family),
reason codes and table schemas. The modules are collected (``modules.py``): a stage's schema
module joins ``ALL_TABLES`` and ``reasons`` by being in this package."""
from . import fields as F
from . import reasons
from .modules import found, merged
from .tables import SchemaError, conform

MODULES = tuple(found())

# every declared table schema, by name (tests/golden holds one str(schema) file per entry)
ALL_TABLES = merged(MODULES, "ALL")

__all__ = ["F", "reasons", "conform", "SchemaError", "ALL_TABLES", "MODULES",
           *(m.__name__.rsplit(".", 1)[1] for m in MODULES)]
