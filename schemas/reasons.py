"""Reason codes: ``<stage>.<reason>``. Every flagged or dropped row carries at least one.

The spine's (ingest) are here; each other stage declares its own in its schema module."""
from __future__ import annotations

from .modules import found, reason_codes

# ingest: the row has no usable image or caption; always dropped by export.
MISSING_FILE = "ingest.missing_file"            # also: img2dataset success, no sample in its shard
MISSING_IMAGE = "ingest.missing_image"          # a record (tar / parquet row) with no image bytes
ZERO_BYTE = "ingest.zero_byte"
UNDECODABLE = "ingest.undecodable_image"
TRUNCATED = "ingest.truncated_image"
TOO_LARGE = "ingest.image_too_large"
TOO_SMALL = "ingest.image_too_small"
MISSING_CAPTION = "ingest.missing_caption"
EMPTY_CAPTION = "ingest.empty_caption"
NON_UTF8 = "ingest.non_utf8_caption"
CAPTION_TOO_LONG = "ingest.caption_too_long"
DUPLICATE_ID = "ingest.duplicate_id"
DOWNLOAD_FAILED = "ingest.download_failed"      # img2dataset status != success
BAD_RECORD = "ingest.bad_record"                # unparsable JSONL line, unreadable tar member, ...
BAD_FILE = "ingest.bad_file"                    # a source file that is not what its name says
BAD_CAPTION = "ingest.bad_caption"              # a JSON caption that is not a string
OUTSIDE_SOURCE = "ingest.outside_source"        # image path resolves outside the source folder
SPECIAL_FILE = "ingest.special_file"            # FIFO, device, socket; tar link or sparse member
FILE_TOO_LARGE = "ingest.file_too_large"        # over source.max_image_bytes: never read

INGEST = (MISSING_FILE, MISSING_IMAGE, ZERO_BYTE, UNDECODABLE, TRUNCATED, TOO_LARGE, TOO_SMALL,
          MISSING_CAPTION, EMPTY_CAPTION, NON_UTF8, CAPTION_TOO_LONG, DUPLICATE_ID, DOWNLOAD_FAILED,
          BAD_RECORD, BAD_FILE, BAD_CAPTION, OUTSIDE_SOURCE, SPECIAL_FILE, FILE_TOO_LARGE)

# Reasons with this prefix can never be exported: the row has no usable image or caption.
MANDATORY_PREFIX = "ingest."

# Every other stage's reason codes, declared in its schema module's ``REASON_CODES`` and
# collected here (``R.LANG_OTHER``, ``R.HPM_NOISE``, ...): a stage's reason is added in its module.
DECLARED = reason_codes(found(), INGEST)
globals().update(DECLARED)
