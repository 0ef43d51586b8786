"""The ingest stage: raw records -> the samples table (one row per record, rejects included)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

import pyarrow as pa

from vlcurate.foundation import storage
from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import reasons as R
from vlcurate.foundation.params import Params, doc, positive, unit, within
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
    kind: Literal["folder", "parquet", "webdataset", "img2dataset"] = doc("folder", (
        "the reader: folder (images + a captions file), parquet, webdataset (tars) or "
        "img2dataset's output"))
    path: str = doc("", "a folder or a URI (s3://, gs://, ...); relative: to the config file")
    name: Optional[str] = doc(None, "the source's name in sample ids; null: the folder's name")
    captions_file: Optional[str] = doc(None, (
        "folder: a CSV, TSV or JSONL of captions, relative to path; null: the first of "
        "readers.CAPTION_FILES found (captions.csv, captions.jsonl, metadata.jsonl, "
        "captions.tsv)"))
    images_dir: str = doc("images", "folder: the images' folder, relative to path; \"\": path "
                                    "itself")
    image_column: str = doc("image", "folder, parquet: the image's file name, path or bytes "
                                     "column")
    caption_column: str = doc("caption", "the caption's column")
    key_column: Optional[str] = doc(None, (
        "a record's key column; null: the image name, plus #n for its n-th caption"))
    extra_columns: tuple[str, ...] = doc((), (
        "columns copied into the extra JSON column and each sample's .json"))
    max_captions_per_image: Optional[int] = positive(None, doc=(
        "folder: keep at most this many captions of an image; null: all"))
    rows_per_part: int = positive(1000, doc=(
        "folder, parquet: rows per part, the unit of work and of commit (tars: one part per "
        "tar)"))
    # Untrusted input: nothing over these limits is read.
    max_image_bytes: int = positive(64 * 1024 * 1024, doc=(
        "a larger file, tar member or Parquet cell is ingest.file_too_large, never read (64 "
        "MiB)"))
    allow_outside_source: bool = doc(False, (
        "true lets image paths resolve outside path (.., absolute paths, symlinks); false: "
        "ingest.outside_source"))
    caption_list: Literal["error", "first"] = doc("error", (
        "a Parquet list<string> caption column: a config error, or take its first element"))
    sample: Optional[float] = unit(None, doc=(
        "quick trials: a share (0, 1] of the records, chosen by sample_id (order-independent); "
        "null: all"))
    limit: Optional[int] = positive(None, doc=(
        "quick trials: the first N records in plan order (vlcurate run --limit N); null: all"))
    also: tuple["SourceParams", ...] = doc((), (
        "more sources in this run, each a section like this one (a top-level sources: list is "
        "the same); names must differ"))
    fingerprint_when_set = ("sample", "limit", "also")

    def check(self) -> Iterable[tuple[str, str]]:
        if self.sample is not None and self.sample <= 0:
            yield ("sample", f"must be a share in (0, 1], got {self.sample!r}")
        yield from sources.check(self)


@dataclass(frozen=True)
class IngestParams(Params):
    """Decoding and normalising each record (stage ``ingest``); every record is one row."""
    max_pixels: int = positive(89_478_485, doc=(
        "an image header declaring more pixels is ingest.image_too_large, before any pixel is "
        "decoded (PIL's bomb threshold)"))
    min_side: int = positive(8, doc="an image with a shorter side is ingest.image_too_small")
    max_caption_chars: int = positive(2048, doc=(
        "a longer caption (after normalisation) is ingest.caption_too_long"))
    reencode: Literal["auto", "always"] = doc("auto", (
        "auto: keep an RGB JPEG's bytes unless it needs an EXIF rotation, re-encode anything "
        "else as an RGB JPEG; always: re-encode every image"))
    jpeg_quality: int = within(95, 1, 100, doc="JPEG quality of re-encoded images")
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
