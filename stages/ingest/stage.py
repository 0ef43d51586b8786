"""The ingest stage: raw records -> the samples table (one row per record, rejects included)."""
from __future__ import annotations

import hashlib
import json
from typing import Any

import pyarrow as pa

from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import Resources, Stage

from . import captions, images, readers


def sample_id(source: str, key: str) -> str:
    """Stable across runs and machines: derived from the source name and the record's key."""
    return hashlib.blake2b(f"{source}\0{key}".encode("utf-8", "surrogateescape"),
                           digest_size=8).hexdigest()


def image_hash(data: bytes) -> str:
    """The content hash of the stored image bytes (what per-image work is keyed by)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _read_detail(ref: str, extra: str | None) -> str:
    """``ref``, and what the reader said was wrong (``{"error": ...}`` in extra), if anything."""
    try:
        error = json.loads(extra).get("error") if extra else None
    except (ValueError, AttributeError):
        error = None
    return f"{ref}: {error}" if isinstance(error, str) and error else f"{ref}"


class IngestStage(Stage):
    name = "ingest"
    version = "3"                    # 2: the source-level contract of issue 11 (new reasons)
    #                                  3: image_hash
    config_sections = ("source", "ingest")
    inputs = {}                      # a source stage: its input is readers.read_part(...)
    output = tables.SAMPLES
    resources = Resources(num_cpus=1, batch_size=0)

    source = True                    # reads a source, not upstream tables
    plan = staticmethod(readers.plan)
    read_part = staticmethod(readers.read_part)
    signature = staticmethod(readers.signature)

    def __init__(self, config: Any, state: Any = None) -> None:
        super().__init__(config, state)
        self.cfg = config.ingest

    def __call__(self, batch: pa.Table) -> pa.Table:
        cfg = self.cfg
        out: dict[str, list] = {f.name: [] for f in self.output}
        cols = {name: batch.column(name).to_pylist() for name in tables.RAW_RECORDS.names}
        for i in range(batch.num_rows):
            source, key = cols[F.SOURCE.name][i], cols[F.KEY.name][i]
            reasons: list[str] = []
            details: list[str] = []
            # a bad caption (a JSON list, ...) is the reader's to know, but the image is still read
            read_error = cols[F.READ_ERROR.name][i]
            bad_caption = read_error == R.BAD_CAPTION
            if read_error and not bad_caption:
                reasons.append(read_error)
                details.append(_read_detail(cols[F.IMAGE_REF.name][i], cols[F.EXTRA.name][i]))
            caption, reason, detail = captions.decode(cols[F.RAW_CAPTION.name][i],
                                                      max_chars=cfg.max_caption_chars)
            if bad_caption:
                caption, reason = None, R.BAD_CAPTION
                detail = _read_detail("caption", cols[F.EXTRA.name][i])
            if reason:
                reasons.append(reason)
                details.append(detail)
            img = None
            if not read_error or bad_caption:
                img = images.decode(cols[F.RAW_IMAGE.name][i], max_pixels=cfg.max_pixels,
                                    min_side=cfg.min_side, reencode=cfg.reencode,
                                    jpeg_quality=cfg.jpeg_quality)
                if isinstance(img, images.Rejected):
                    reasons.insert(0, img.reason)
                    details.insert(0, img.detail)
                    img = None
            row = {F.SAMPLE_ID.name: sample_id(source, key), F.SOURCE.name: source,
                   F.KEY.name: key, F.IMAGE_REF.name: cols[F.IMAGE_REF.name][i],
                   F.CAPTION.name: caption, F.EXTRA.name: cols[F.EXTRA.name][i],
                   F.REASONS.name: reasons, F.REASON_DETAIL.name: "; ".join(details) or None,
                   F.IMAGE.name: img.data if img else None,
                   F.IMAGE_HASH.name: image_hash(img.data) if img else None,
                   F.WIDTH.name: img.width if img else None,
                   F.HEIGHT.name: img.height if img else None,
                   F.IMAGE_FORMAT.name: img.format if img else None,
                   F.IMAGE_MODE.name: img.mode if img else None,
                   F.IMAGE_REENCODED.name: img.reencoded if img else None}
            for k, v in row.items():
                out[k].append(v)
        return conform(pa.table(out), self.output)
