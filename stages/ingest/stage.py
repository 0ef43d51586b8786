"""The ingest stage: raw records -> the samples table (one row per record, rejects included)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

import pyarrow as pa

from vlcurate.pipeline import storage
from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import reasons as R
from vlcurate.pipeline.params import Params, positive, unit, within
from vlcurate.stages.base import Finding, Resources, SourceStage

from . import captions, census, images, keys, readers, sources
from .sources import sample_id


def image_hash(data: bytes) -> str:
    """The content hash of the stored image bytes (what per-image work is keyed by)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _read_detail(ref: str, extra: str | None) -> str:
    """``ref``, and what the reader said was wrong (``{"error": ...}`` in extra), if anything."""
    try:
        error = json.loads(extra).get(F.EXTRA_ERROR_KEY) if extra else None
    except (ValueError, AttributeError):
        error = None
    return f"{ref}: {error}" if isinstance(error, str) and error else f"{ref}"


@dataclass(frozen=True)
class SourceParams(Params):
    """Where the records come from (section ``source``; the readers see only this section, so
    the read limits live here)."""
    kind: Literal["folder", "parquet", "webdataset", "img2dataset"] = "folder"
    path: str = ""                       # a folder or a URI (s3://, gs://, ...)
    name: Optional[str] = None           # default: the source folder's name
    # folder: a captions CSV or JSONL (relative to path) and the folder the images are in
    captions_file: Optional[str] = None  # default: captions.csv, captions.jsonl or metadata.jsonl
    images_dir: str = "images"           # relative to path; "" = path itself
    image_column: str = "image"          # folder/parquet: file name / path / bytes column
    caption_column: str = "caption"
    key_column: Optional[str] = None     # default: image name (+ "#n" for its n-th caption)
    extra_columns: tuple[str, ...] = ()  # copied into the `extra` JSON column
    max_captions_per_image: Optional[int] = positive(None)
    rows_per_part: int = positive(1000)  # folder/parquet: rows per part; tars: one part per tar
    # Untrusted input: a file, tar member or Parquet cell over max_image_bytes is rejected
    # (ingest.file_too_large) before it is read; an image path resolving outside source.path is
    # ingest.outside_source unless allowed; a Parquet list<string> caption column is a config
    # error unless caption_list: first.
    max_image_bytes: int = positive(64 * 1024 * 1024)
    allow_outside_source: bool = False
    caption_list: Literal["error", "first"] = "error"
    # quick trials (stages/ingest/sources.py): a share of the records, chosen by sample_id (so
    # independent of order), and/or the first `limit` records (`vlcurate run --limit N`)
    sample: Optional[float] = unit(None)
    limit: Optional[int] = positive(None)
    # more sources in the same run, each a section like this one (a top-level `sources:` list
    # in YAML is the same thing); sample_id keeps each record's source name
    also: tuple["SourceParams", ...] = ()
    fingerprint_when_set = ("sample", "limit", "also")

    def check(self) -> Iterable[tuple[str, str]]:
        if self.sample is not None and self.sample <= 0:
            yield ("sample", f"must be a share in (0, 1], got {self.sample!r}")
        yield from sources.check(self)


@dataclass(frozen=True)
class IngestParams(Params):
    max_pixels: int = positive(89_478_485)   # PIL's own bomb threshold; larger headers rejected
    min_side: int = positive(8)
    max_caption_chars: int = positive(2048)
    # auto: keep the source bytes when they are an RGB JPEG needing no EXIF rotation, else
    # re-encode the decoded RGB image as JPEG; always: always re-encode
    reencode: Literal["auto", "always"] = "auto"
    jpeg_quality: int = within(95, 1, 100)
    resources: Resources = Resources()


class IngestStage(SourceStage):
    name = "ingest"
    version = "4"                    # history: CHANGELOG.md
    Params = IngestParams
    inputs = {}                      # a source stage: its input is readers.read_part(...)
    output = tables.SAMPLES
    resources = Resources(num_cpus=1, batch_size=0)
    expected_reject = 0.50   # broken files and captions (img2dataset sets lose 20-40% to downloads)
    knobs = {R.MISSING_FILE: "source.path / source.images_dir / source.image_column",
             R.CAPTION_TOO_LONG: "ingest.max_caption_chars",
             R.TOO_SMALL: "ingest.min_side",
             R.TOO_LARGE: "ingest.max_pixels",
             R.FILE_TOO_LARGE: "source.max_image_bytes",
             R.OUTSIDE_SOURCE: "source.allow_outside_source",
             R.BAD_CAPTION: "source.caption_column (the column of caption text)",
             R.MISSING_CAPTION: "source.caption_column (the column of caption text)",
             "ingest.*": "the source settings (source.path, source.kind, source.caption_column; "
                         "`vlcurate inspect RUN_DIR` shows examples)"}

    @classmethod
    def preflight(cls, config: Any, stages: frozenset[str]) -> list[Finding]:
        from .preflight import check_sources
        return check_sources(config.source)

    @classmethod
    def sections(cls) -> dict[str, type]:
        return {"source": SourceParams, "ingest": IngestParams}

    @classmethod
    def plan(cls, cfg: Any, plan_uri: str) -> list[dict]:
        return sources.plan(cfg.source, plan_uri)

    @classmethod
    def read_part(cls, cfg: Any, spec: dict) -> Any:
        return sources.read_part(cfg.source, spec)

    @classmethod
    def signature(cls, cfg: Any) -> str:
        return sources.signature(cfg.source)

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        return sources.notes(config.source)

    @classmethod
    def finalize(cls, cfg: Any, ctx: Any) -> dict:
        """The books: every part's rows against the sources' second count (``census``),
        counted now in parallel tasks (``ctx.map``) and kept beside the plan's listing."""
        books = census.count_all(json.loads(storage.read_bytes(ctx.uri(sources.CENSUS))),
                                 ctx.map)
        ctx.write_bytes(sources.CENSUS, json.dumps(books).encode())
        return {"second_count": census.check(books, [c[F.MK.ROWS] for c in ctx.counts])}

    def __call__(self, batch: pa.Table) -> pa.Table:
        cfg = self.config.ingest
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
                   F.KEY.name: key, F.KEY_INVENTED.name: keys.invented(key),
                   F.IMAGE_REF.name: cols[F.IMAGE_REF.name][i],
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
