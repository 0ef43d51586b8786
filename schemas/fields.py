"""Every column of every vlcurate table, declared once.

Stages, the pipeline and the tests refer to columns only through these objects (``F.CAPTION.name``),
never through string literals, so a rename or a type change is one reviewed diff here and in the
golden schema files under ``tests/golden``.
"""
from __future__ import annotations

import pyarrow as pa


def embedding(name: str, dim: int, *, float16: bool = False, nullable: bool = True) -> pa.Field:
    """An embedding column: ``fixed_size_list<float32|float16, dim>``."""
    value = pa.float16() if float16 else pa.float32()
    return pa.field(name, pa.list_(value, dim), nullable=nullable)


# --- identity -------------------------------------------------------------------------------
SAMPLE_ID = pa.field("sample_id", pa.string(), nullable=False,
                     metadata={"doc": "stable id: blake2b-64 of (source name, source key), hex"})
SOURCE = pa.field("source", pa.string(), nullable=False,
                  metadata={"doc": "source name from config (default: the source folder name)"})
KEY = pa.field("key", pa.string(), nullable=False,
               metadata={"doc": "the record's key inside its source (file name, tar key, row key)"})
KEY_INVENTED = pa.field("key_invented", pa.bool_(), metadata={
    "doc": "true when the source gave the record no key and one was made from its place in the "
           "source ('\u2205:' + file:position; a real key never starts so)"})

# --- ingest: image ----------------------------------------------------------------------------
IMAGE = pa.field("image", pa.binary(), metadata={"doc": "RGB image bytes (JPEG unless passthrough)"})
IMAGE_HASH = pa.field("image_hash", pa.string(), metadata={
    "doc": "blake2b-128 of the stored image bytes, hex: rows with equal hashes show the same image "
           "(COCO and Flickr give five captions per image), and per-image work is done once"})
IMAGE_GROUP = pa.field("image_group", pa.string(), metadata={
    "doc": "the row's image group: its image_hash (every caption of one image shares it), or its "
           "own sample_id when it has no image; null on rows ingest rejected. Another caption of "
           "the same image is a relation of its own, never a near-duplicate to drop"})
IMAGE_REF = pa.field("image_ref", pa.string(),
                     metadata={"doc": "where the image came from (path or tar member)"})
WIDTH = pa.field("width", pa.int32())
HEIGHT = pa.field("height", pa.int32())
IMAGE_FORMAT = pa.field("image_format", pa.string(),
                        metadata={"doc": "format of the source bytes as decoded (JPEG, PNG, WEBP, ...)"})
IMAGE_MODE = pa.field("image_mode", pa.string(),
                      metadata={"doc": "PIL mode of the source image before conversion to RGB"})
IMAGE_REENCODED = pa.field("image_reencoded", pa.bool_(),
                           metadata={"doc": "true when the stored bytes are a re-encode, not the source"})

# --- ingest: caption --------------------------------------------------------------------------
CAPTION = pa.field("caption", pa.string(), metadata={"doc": "NFC-normalised, whitespace-collapsed"})
EXTRA = pa.field("extra", pa.string(),
                 metadata={"doc": "JSON object of extra source columns / sidecar json, passed through"})

# --- raw records (reader output, ingest input; never written to the run dir) -----------------
RAW_IMAGE = pa.field("raw_image", pa.binary(), metadata={"doc": "image bytes as read; null if absent"})
RAW_CAPTION = pa.field("raw_caption", pa.binary(), metadata={"doc": "caption bytes as read; null if absent"})
READ_ERROR = pa.field("read_error", pa.string(),
                      metadata={"doc": "reason code the reader already knows (missing file, ...)"})
# a folder source's plan (``<run>/ingest/_plan.parquet``): each record's image path as written,
# and what the reader found wrong with its line
PLAN_IMAGE_PATH = pa.field("image_path", pa.binary())
PLAN_ERROR = pa.field("error", pa.string())
# the key of the reader's note in a row's ``extra`` JSON (``{"error": ...}``)
EXTRA_ERROR_KEY = "error"

# --- decisions ----------------------------------------------------------------------------------
REASONS = pa.field("reasons", pa.list_(pa.string()), nullable=False,
                   metadata={"doc": "reason codes this stage flagged the row with; empty = passed"})
REASON_DETAIL = pa.field("reason_detail", pa.string(),
                         metadata={"doc": "human-readable detail for the first reason"})
# position of a row inside its part: internal to the runner, never written to stage tables
PART = pa.field("_part", pa.int64(), nullable=False)
ROW = pa.field("_row", pa.int64(), nullable=False)
PART_ROWS = pa.field("_part_rows", pa.int64(), nullable=False)
# the row is still kept (no upstream stage flagged it): the runner computes only these
ACTIVE = pa.field("_active", pa.bool_(), nullable=False)
# the row itself is still kept (ACTIVE may add, for a per-image stage, the other rows of a kept
# row's image group: computed and joined, but neither counted nor flagged by the stage)
WANTED = pa.field("_wanted", pa.bool_(), nullable=False)
# how far a row is flagged after the stages so far (pipeline/parts.py): 0 kept, 1 flagged, 2
# flagged by a mandatory (ingest) reason; committed per part in each stage's commit record
FLAG_LEVEL = pa.field("_flag_level", pa.int8(), nullable=False)
# a per-image stage's image passes (pipeline/homes.py): the row's image group when its part is
# the group's home (the home pass), the results its home computed for it (pickled), and the
# distinct images a call computed (on its first row)
IMAGE_HOME = pa.field("_image_home", pa.string())
IMAGE_VALUE = pa.field("_image_value", pa.binary())
IMAGES = pa.field("_images", pa.int64(), nullable=False)
KEEP = pa.field("keep", pa.bool_(), nullable=False, metadata={"doc": "export decision under the policy"})
ALL_REASONS = pa.field("all_reasons", pa.list_(pa.string()), nullable=False,
                       metadata={"doc": "every reason code any stage flagged the row with"})
STAGE = pa.field("stage", pa.string(), nullable=False)
REASON = pa.field("reason", pa.string(), nullable=False)
SHARD = pa.field("shard", pa.string(), metadata={"doc": "WebDataset shard the kept row was written to"})

# --- stage manifest ----------------------------------------------------------------------------
M_STAGE = pa.field("stage", pa.string(), nullable=False)
M_STATUS = pa.field("status", pa.string(), nullable=False, metadata={"doc": "running | complete"})
M_FINGERPRINT = pa.field("fingerprint", pa.string(), nullable=False)
M_UPSTREAM = pa.field("upstream", pa.map_(pa.string(), pa.string()), nullable=False,
                      metadata={"doc": "upstream stage name -> its fingerprint"})
M_CONFIG = pa.field("config", pa.string(), nullable=False, metadata={"doc": "stage config as JSON"})
M_PARTS = pa.field("parts", pa.int64(), nullable=False)
M_PARTS_REUSED = pa.field("parts_reused", pa.int64(), nullable=False,
                          metadata={"doc": "parts committed by an earlier, interrupted attempt"})
M_ROWS = pa.field("rows", pa.int64(), nullable=False, metadata={"doc": "rows in the stage table"})
M_ROWS_IN = pa.field("rows_in", pa.int64(), nullable=False,
                     metadata={"doc": "rows still kept when they reached the stage"})
M_ROWS_KEPT = pa.field("rows_kept", pa.int64(), nullable=False)
M_ROWS_REJECTED = pa.field("rows_rejected", pa.int64(), nullable=False)
M_REASON_COUNTS = pa.field("reason_counts", pa.map_(pa.string(), pa.int64()), nullable=False)
M_WALL_S = pa.field("wall_s", pa.float64(), nullable=False)
M_STARTED = pa.field("started_at", pa.string(), nullable=False)
M_FINISHED = pa.field("finished_at", pa.string())
M_VERSIONS = pa.field("versions", pa.map_(pa.string(), pa.string()), nullable=False)



class MK:
    """The keys of a stage's manifest dict (``_manifest.json``; the columns of summary.parquet)
    and of a part's counts in its commit record."""
    ROWS = M_ROWS.name
    ROWS_IN = M_ROWS_IN.name
    ROWS_KEPT = M_ROWS_KEPT.name
    ROWS_REJECTED = M_ROWS_REJECTED.name
    REASON_COUNTS = M_REASON_COUNTS.name
    PARTS_REUSED = M_PARTS_REUSED.name
    WALL_S = M_WALL_S.name
    STARTED = M_STARTED.name
    FINISHED = M_FINISHED.name
    FINGERPRINT = M_FINGERPRINT.name
    FLAG_LEVELS = "flag_levels"     # a commit record's rows' flag levels (zlib, base64)
    FIRST_ROW = "first_row"         # a fragment record's first row in its part
    IMAGES = "images"               # distinct images a per-image stage computed in the part

# --- shard manifest ----------------------------------------------------------------------------
SH_NAME = pa.field("shard", pa.string(), nullable=False)
SH_SAMPLES = pa.field("samples", pa.int64(), nullable=False)
SH_ROWS = pa.field("rows", pa.int64(), nullable=False, metadata={
    "doc": "the kept rows a shard holds: one per sample in the pair layout, one per caption of "
           "its image samples in the image layout"})
SH_BYTES = pa.field("bytes", pa.int64(), nullable=False)
SH_FIRST = pa.field("first_sample_id", pa.string())
SH_LAST = pa.field("last_sample_id", pa.string())

# --- shard index (shards/index/*.parquet): where each tar member of a sample lies -----------------
SHARD_MEMBERS = ("jpg", "txt", "json")      # a sample's tar members, by extension
SH_JPG_OFFSET = pa.field("jpg_offset", pa.int64(), nullable=False)
SH_JPG_SIZE = pa.field("jpg_size", pa.int64(), nullable=False)
SH_TXT_OFFSET = pa.field("txt_offset", pa.int64(), nullable=False)
SH_TXT_SIZE = pa.field("txt_size", pa.int64(), nullable=False)
SH_JSON_OFFSET = pa.field("json_offset", pa.int64(), nullable=False)
SH_JSON_SIZE = pa.field("json_size", pa.int64(), nullable=False)
SH_CAPTION = pa.field("caption_index", pa.int32(), metadata={
    "doc": "export.layout image: the row's position in its image sample's json `captions`; null "
           "in the pair layout (one sample per row)"})
# member extension -> (offset field, size field)
SH_RANGES = {"jpg": (SH_JPG_OFFSET, SH_JPG_SIZE), "txt": (SH_TXT_OFFSET, SH_TXT_SIZE),
             "json": (SH_JSON_OFFSET, SH_JSON_SIZE)}
