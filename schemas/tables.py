"""Table schemas, built from the fields in :mod:`schemas.fields`, and the conform helper."""
from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from . import fields as F


def stage_table(*columns: pa.Field) -> pa.Schema:
    """The narrow table a stage writes: the key, its own columns, and its decision columns."""
    return pa.schema([F.SAMPLE_ID, *columns, F.REASONS, F.REASON_DETAIL])


# What a reader hands to the ingest stage, one row per source record (not persisted).
RAW_RECORDS = pa.schema([F.SOURCE, F.KEY, F.IMAGE_REF, F.RAW_IMAGE, F.RAW_CAPTION, F.EXTRA,
                         F.READ_ERROR])

# The ingest table: one row per source record, rejected rows included (image null, reasons set).
SAMPLES = stage_table(F.SOURCE, F.KEY, F.KEY_INVENTED, F.IMAGE_REF, F.CAPTION, F.IMAGE,
                      F.IMAGE_HASH, F.WIDTH, F.HEIGHT, F.IMAGE_FORMAT, F.IMAGE_MODE,
                      F.IMAGE_REENCODED, F.EXTRA)

# Duplicate-id check over the whole ingest table (a global step), and each row's image group.
IDS = stage_table(F.IMAGE_GROUP)

# Rows a stage flagged, one row each (written beside every stage table, under rejects/).
REJECTS = pa.schema([F.SAMPLE_ID, F.STAGE, F.REASONS, F.REASON_DETAIL])

# Export: decision columns appended to the joined annotations (its `reasons` are the reasons
# the policy dropped the row for, so export/rejects/ lists exactly the rows left out).
EXPORT_DECISION = [F.KEEP, F.ALL_REASONS]

# One row per stage: the content of <stage>/_manifest.json and of <run>/summary.parquet.
MANIFEST = pa.schema([F.M_STAGE, F.M_STATUS, F.M_FINGERPRINT, F.M_UPSTREAM, F.M_CONFIG, F.M_PARTS,
                      F.M_PARTS_REUSED, F.M_ROWS, F.M_ROWS_IN, F.M_ROWS_KEPT, F.M_ROWS_REJECTED,
                      F.M_REASON_COUNTS, F.M_WALL_S, F.M_STARTED, F.M_FINISHED,
                      F.M_VERSIONS])

SHARDS = pa.schema([F.SH_NAME, F.SH_SAMPLES, F.SH_ROWS, F.SH_BYTES, F.SH_FIRST, F.SH_LAST])

# shards/index/*.parquet: byte offsets of every sample's members inside its tar (random access)
SHARD_INDEX = pa.schema([F.SAMPLE_ID, F.SH_NAME,
                         *(f for ext in F.SHARD_MEMBERS for f in F.SH_RANGES[ext]),
                         F.IMAGE_GROUP, F.SH_CAPTION])

ALL = {"raw_records": RAW_RECORDS, "samples": SAMPLES, "ids": IDS, "rejects": REJECTS,
       "manifest": MANIFEST, "shards": SHARDS, "shard_index": SHARD_INDEX}


class SchemaError(ValueError):
    pass


def conform(table: pa.Table, schema: pa.Schema, *, extra: str = "error") -> pa.Table:
    """Return ``table`` with exactly ``schema``'s columns, in order, cast to its types.

    A missing nullable column is filled with nulls; a missing non-nullable column, a null in a
    non-nullable column or an impossible cast raises :class:`SchemaError` naming the column.
    ``extra``: ``"error"`` (default) rejects columns the schema does not declare, ``"drop"``
    drops them.
    """
    unknown = [n for n in table.column_names if schema.get_field_index(n) < 0]
    if unknown and extra == "error":
        raise SchemaError(f"columns not declared in the schema: {unknown}")
    arrays = []
    for field in schema:
        if field.name not in table.column_names:
            if not field.nullable:
                raise SchemaError(f"missing required column {field.name!r}")
            arrays.append(pa.nulls(table.num_rows, field.type))
            continue
        col = table.column(field.name)
        if not field.nullable and col.null_count:
            raise SchemaError(f"column {field.name!r} has {col.null_count} nulls but is required")
        if col.type != field.type:
            try:
                col = col.cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaError(f"column {field.name!r}: cannot cast {col.type} to {field.type}: {e}")
        arrays.append(col)
    return pa.Table.from_arrays(arrays, schema=schema)


def merge(schemas: Iterable[pa.Schema]) -> pa.Schema:
    """Union of several stage schemas; the key appears once, a column declared twice is an error."""
    out: list[pa.Field] = [F.SAMPLE_ID]
    seen = {F.SAMPLE_ID.name}
    for s in schemas:
        for f in s:
            if f.name in seen:
                continue
            seen.add(f.name)
            out.append(f)
    return pa.schema(out)

# A per-image result cache segment (stages/cache.py): an image hash and its stage's result as
# JSON (exact: JSON round-trips floats). No field metadata: a segment is named by its content.
CACHE_VALUE = pa.field("value", pa.string())
IMAGE_CACHE = pa.schema([pa.field(F.IMAGE_HASH.name, pa.string()), CACHE_VALUE])
