"""Export's two shard layouts (``export.layout``), as the samples a shard holds.

* ``pair``: one sample per kept row, keyed by ``sample_id``: ``.jpg``, ``.txt`` (its caption) and
  ``.json`` (its annotations). What open_clip and every WebDataset trainer expect; an image with
  five captions is stored five times.
* ``image``: one sample per image group, keyed by ``image_group``: ``.jpg`` once, ``.txt`` the
  first kept caption (what open_clip trains on: one caption per image), and ``.json`` holding
  ``{"image": per-image annotations, "captions": [each kept row's own annotations]}``. A row's
  positives among the other captions of its image are left out (every trainer that reads groups
  makes them positives). Rows are grouped within each part's slice of a shard: an image whose
  captions lie in two parts is two samples.

Per-image annotations are the columns of the per-image stages (recaptions, concept targets,
spotted text) and the image's own fields; everything else is per caption.
"""
from __future__ import annotations

import json
from typing import Iterator

import pyarrow as pa

from vlcurate.schemas import F
from vlcurate.schemas import cat as CA
from vlcurate.schemas import concepts as CO
from vlcurate.schemas import mining as MI
from vlcurate.schemas import recaption as RC

LAYOUTS = ("image", "pair")
PER_IMAGE = frozenset(f.name for f in (
    F.IMAGE_GROUP, F.IMAGE_HASH, F.IMAGE_REF, F.WIDTH, F.HEIGHT, F.IMAGE_FORMAT, F.IMAGE_MODE,
    F.IMAGE_REENCODED, CA.OCR_TEXTS, CA.OCR_CONFS, *RC.RECAPTION, *CO.CONCEPT_TARGETS)
    if f.name not in (F.SAMPLE_ID.name, F.REASONS.name, F.REASON_DETAIL.name))
_ALIGNED = (MI.POSITIVE_IDS.name, MI.POSITIVE_CAPTIONS.name, MI.POSITIVE_RELATIONS.name,
            MI.POSITIVE_SCORES.name)
JPG, TXT, JSON = F.SHARD_MEMBERS


def _json(value: dict) -> bytes:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str).encode("utf-8")


def samples(layout: str, rows: list[dict], images: list[bytes], metas: list[dict]
            ) -> Iterator[tuple[str, dict, list[tuple[str, str, int]]]]:
    """(key, {ext: bytes}, [(sample_id, image group, caption index)]) of each sample, in order
    of the rows (``metas``: each row's json annotations)."""
    if layout == "pair":
        for row, image, meta in zip(rows, images, metas):
            sid = row[F.SAMPLE_ID.name]
            yield sid, {JPG: image, TXT: row[F.CAPTION.name].encode("utf-8"), JSON: _json(meta)}, \
                [(sid, row.get(F.IMAGE_GROUP.name) or sid, None)]
        return
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.get(F.IMAGE_GROUP.name) or row[F.SAMPLE_ID.name], []).append(i)
    for group, at in groups.items():
        ids = {rows[i][F.SAMPLE_ID.name] for i in at}
        doc = {"image": {k: v for k, v in metas[at[0]].items() if k in PER_IMAGE},
               "captions": [own_captions(metas[i], ids) for i in at]}
        yield group, {JPG: images[at[0]], TXT: rows[at[0]][F.CAPTION.name].encode("utf-8"),
                      JSON: _json(doc)}, \
            [(rows[i][F.SAMPLE_ID.name], group, k) for k, i in enumerate(at)]


def own_captions(meta: dict, group_ids: set) -> dict:
    """A row's per-caption annotations, less its positives among its own image's captions."""
    out = {k: v for k, v in meta.items() if k not in PER_IMAGE}
    pos = out.get(MI.POSITIVE_IDS.name)
    if pos:
        keep = [j for j, p in enumerate(pos) if p not in group_ids]
        for col in _ALIGNED:
            if out.get(col) is not None:
                out[col] = [out[col][j] for j in keep]
    return out


def read_sample(members: dict, caption_index) -> tuple[str, dict]:
    """(caption, annotations) of one row from its sample's members, in either layout."""
    meta = json.loads(members[JSON])
    if caption_index is None or caption_index < 0:
        return members[TXT].decode("utf-8"), meta
    own = meta["captions"][caption_index]
    return own[F.CAPTION.name], {**meta["image"], **own}


__all__ = ["LAYOUTS", "PER_IMAGE", "samples", "read_sample", "own_captions"]
