"""An evaluation set given by the user (``finetune.eval_data``, as open_clip's ``--val-data``),
and retrieval over distinct images (the Flickr/COCO protocol).

``eval_data`` is one of:
- a shards folder (``manifest.json``: a ``vlcurate run`` export);
- a Parquet file, or a folder of them, with the columns ``image`` (bytes) and ``caption``;
- a folder of images with ``captions.csv`` (columns ``image``, a file name relative to the folder
  or its ``images/``, and ``caption``), as the ingest folder source reads.

Rows with the same image bytes are one image with several captions. A row whose image is missing
or does not decode, or whose caption is empty or not UTF-8, is left out and counted
(``rejected``, by reason): rows = kept + rejected.
"""
from __future__ import annotations

import csv
import hashlib
import io
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from vlcurate.foundation import storage
from vlcurate.schemas import F

from .data import ShardSet, load_rgb
from .index import MANIFEST

CAPTIONS_CSV = "captions.csv"


@dataclass
class EvalSet:
    images: list[bytes]          # distinct images
    captions: list[str]
    owner: list[int]             # each caption's image
    rows: int = 0
    rejected: Counter = field(default_factory=Counter)


def load_eval_set(uri: str) -> EvalSet:
    """The (image bytes, caption) rows of ``uri`` (shards, Parquet or a folder), grouped."""
    if storage.exists(storage.join(uri, MANIFEST)):
        return group(_shard_rows(uri))
    if storage.is_local(uri) and (Path(storage.local_path(uri)) / CAPTIONS_CSV).exists():
        return group(_folder_rows(Path(storage.local_path(uri))))
    if uri.endswith(".parquet") or _parquet_files(uri):
        return group(_parquet_rows(uri))
    raise FileNotFoundError(f"finetune.eval_data {storage.redact(uri)}: not a shards folder "
                            f"({MANIFEST}), a Parquet file or folder, or a folder with "
                            f"{CAPTIONS_CSV}")


def _shard_rows(uri: str) -> Iterable[tuple[Optional[bytes], Optional[str]]]:
    from .data import read_ahead
    shards = ShardSet(uri)
    for s in read_ahead(shards.sample, shards.rows.tolist()):
        yield s.image, s.caption


def _parquet_files(uri: str) -> list[str]:
    if not storage.is_local(uri) or not Path(storage.local_path(uri)).is_dir():
        return []
    return sorted(str(p) for p in Path(storage.local_path(uri)).rglob("*.parquet"))


def _parquet_rows(uri: str) -> Iterable[tuple[Optional[bytes], Optional[str]]]:
    import pyarrow.parquet as pq
    files = [uri] if uri.endswith(".parquet") else _parquet_files(uri)
    cols = [F.IMAGE.name, F.CAPTION.name]
    for f in files:
        fs, inner = storage.resolve(f)
        names = pq.read_schema(inner, filesystem=fs).names
        missing = [c for c in cols if c not in names]
        if missing:
            raise ValueError(f"finetune.eval_data {storage.redact(f)}: no column "
                             f"{', '.join(missing)} (expected {', '.join(cols)})")
        t = pq.read_table(inner, columns=cols, filesystem=fs)
        yield from zip(t.column(0).to_pylist(), t.column(1).to_pylist())


def _folder_rows(root: Path) -> Iterable[tuple[Optional[bytes], Optional[str]]]:
    text = (root / CAPTIONS_CSV).read_bytes().decode("utf-8", "surrogateescape")
    for rec in csv.DictReader(io.StringIO(text)):
        name = rec.get(F.IMAGE.name) or ""
        path = next((p for p in (root / name, root / "images" / name) if name and p.is_file()),
                    None)
        yield (path.read_bytes() if path else None), rec.get(F.CAPTION.name)


def reject_reason(image: Optional[bytes], caption: Optional[str]) -> Optional[str]:
    if not image:
        return "missing_image"
    if caption is None or not caption.strip():
        return "empty_caption"
    try:
        caption.encode("utf-8")
    except UnicodeEncodeError:
        return "caption_not_utf8"
    try:
        load_rgb(image, 32)
    except Exception:  # noqa: BLE001 (PIL raises many kinds for bad bytes)
        return "image_unreadable"
    return None


def group(rows: Iterable[tuple[Optional[bytes], Optional[str]]]) -> EvalSet:
    out = EvalSet([], [], [])
    at: dict[str, int] = {}
    for image, caption in rows:
        out.rows += 1
        why = reject_reason(image, caption)
        if why:
            out.rejected[why] += 1
            continue
        h = hashlib.sha256(image).hexdigest()
        if h not in at:
            at[h] = len(out.images)
            out.images.append(image)
        out.captions.append(caption)
        out.owner.append(at[h])
    return out


def image_retrieval(img: torch.Tensor, txt: torch.Tensor, owner: torch.Tensor,
                    ks: tuple[int, ...] = (1, 5, 10)) -> dict:
    """R@k over distinct images: image->text is a hit when any caption of the image ranks in the
    top k; text->image when the caption's image does. A tie with a true match counts against
    it (as ``retrieval_metrics``)."""
    sim = img @ txt.T                                             # [images, texts]
    own = owner[None, :] == torch.arange(img.shape[0])[:, None]
    best = sim.masked_fill(~own, float("-inf")).max(1).values     # each image's best caption
    i2t_beaten = ((sim >= best[:, None]) & ~own).sum(1)
    true = sim[owner, torch.arange(txt.shape[0])]                 # each caption's own image
    t2i_beaten = (sim.T >= true[:, None]).sum(1) - 1
    out: dict = {"images": int(img.shape[0]), "texts": int(txt.shape[0])}
    for k in ks:
        out[f"i2t_R@{k}"] = float((i2t_beaten < k).float().mean())
        out[f"t2i_R@{k}"] = float((t2i_beaten < k).float().mean())
    return out
