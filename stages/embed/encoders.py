"""The two unimodal encoders HELIP mines hard pairs with, behind small wrappers that own their
preprocessing and batching: a timm model (a ViT's CLS token of ``forward_features``, else its
pooled pre-logits features: EfficientNet-Lite0's 1,280) and a SentenceTransformer; and FFF's cross-modal (CLIP-style) encoder, whose image and caption
features share one space. All return L2-normalised float32 numpy arrays."""
from __future__ import annotations

import contextlib
import io
from typing import Any, Iterable, Sequence

import numpy as np

from vlcurate.foundation import models
from vlcurate.foundation.widths import cross_width, sentence_dim
from vlcurate.stages.base import decoded_batches


def _autocast(device: str, dtype: Any) -> Any:
    import torch
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if device.startswith("cuda") else "cpu", dtype=dtype)


class ImagePreprocessor:
    """The model's own eval transform, split: geometry on PIL (CPU, anywhere) | normalise (here).
    Built from the architecture and its pretrained config only: no weights are loaded."""

    def __init__(self, spec: Any, model: Any = None) -> None:
        import timm

        if model is None:               # the architecture on the meta device: no memory, no init
            from vlcurate.foundation.widths import meta_timm
            model = meta_timm(spec)
        cfg = models.data_config(spec, model)      # the weights' own (a packaged model's too)
        steps = list(timm.data.create_transform(**cfg, is_training=False).transforms)
        cut = next(i for i, t in enumerate(steps) if type(t).__name__ in ("ToTensor", "MaybeToTensor",
                                                                            "PILToTensor"))
        self.geometry = steps[:cut]                    # resize, centre crop (the model's own)
        self.mean = np.asarray(cfg["mean"], np.float32).reshape(3, 1, 1)
        self.std = np.asarray(cfg["std"], np.float32).reshape(3, 1, 1)
        self.input_size = tuple(cfg["input_size"])
        self.dim = int(model.num_features)

    def pixels(self, data: bytes) -> np.ndarray:
        """Image bytes -> uint8 CHW at the model's input size (the one decode in this stage)."""
        from PIL import Image
        im = Image.open(io.BytesIO(data)).convert("RGB")
        for t in self.geometry:
            im = t(im)
        return np.asarray(im, np.uint8).transpose(2, 0, 1)


class ImageEncoder:
    def __init__(self, spec: Any) -> None:
        self.loaded = models.load_timm(spec)
        self.model = self.loaded.model
        self.pre = ImagePreprocessor(spec, self.model)
        self.pixels, self.dim = self.pre.pixels, self.pre.dim
        self.mean, self.std = self.pre.mean, self.pre.std

    # --- model side ----------------------------------------------------------------------------
    def encode_pixels(self, pixels: np.ndarray) -> np.ndarray:
        import torch
        x = (pixels.astype(np.float32) / 255.0 - self.mean) / self.std
        x = torch.from_numpy(x).to(self.loaded.device, non_blocking=True)
        with torch.inference_mode(), _autocast(self.loaded.device, self.loaded.dtype):
            feats = self.model.forward_features(x)
            if feats.ndim == 3 and getattr(self.model, "num_prefix_tokens", 1) > 0:
                cls = feats[:, 0]                      # the CLS token (ViT / DINO)
            else:
                cls = self.model.forward_head(feats, pre_logits=True)
        cls = torch.nn.functional.normalize(cls.float(), dim=-1)
        return cls.cpu().numpy()

    def encode(self, images: Sequence[bytes], batch_size: int, threads: int = 0) -> np.ndarray:
        """Decode in ``threads`` (ahead of the model, overlapping it) and encode in batches."""
        out = np.zeros((len(images), self.dim), np.float32)
        for lo, chunk in decoded_batches(images, self.pixels, batch_size, threads):
            out[lo:lo + len(chunk)] = self.encode_pixels(np.stack(chunk))
        return out

    def encode_preprocessed(self, pixels: Iterable[np.ndarray], batch_size: int) -> np.ndarray:
        arr = np.stack(list(pixels)) if not isinstance(pixels, np.ndarray) else pixels
        out = [self.encode_pixels(arr[lo:lo + batch_size]) for lo in range(0, len(arr), batch_size)]
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)


class TextEncoder:
    def __init__(self, spec: Any) -> None:
        self.loaded = models.load_sentence_transformer(spec)
        self.model = self.loaded.model
        self.dim = sentence_dim(self.model)

    def encode(self, captions: Sequence[str], batch_size: int) -> np.ndarray:
        import torch
        if not captions:
            return np.zeros((0, self.dim), np.float32)
        with torch.inference_mode(), _autocast(self.loaded.device, self.loaded.dtype):
            emb = self.model.encode(list(captions), batch_size=batch_size, convert_to_numpy=True,
                                    normalize_embeddings=True, show_progress_bar=False)
        return emb.astype(np.float32, copy=False)


class CrossEncoder:
    """FFF sec. 4.1's image-text model, the projected image and text features, L2-normalised:
    a transformers CLIPModel (``models.load_clip``), or a ``vlcurate finetune`` output (its
    ``encoder.json`` folder, loaded by the trainer's registered loader: the same encoder its
    evaluation uses). Images get the trainer's eval transform (``finetune.data``: short side
    resized, centre crop, the model's mean/std), captions its tokenizer padded to a fixed length.
    The model always sees exactly ``batch_size`` rows (the last chunk padded with copies of its
    last row): how Ray cuts the rows into batches never changes a row's bytes."""

    def __init__(self, spec: Any) -> None:
        import torch
        self._torch = torch
        self.device = models.device_for(spec)
        self.dtype = models.dtype_for(spec, self.device)
        folder = models.finetune_dir(spec)
        if folder is None:
            self.loaded = models.load_clip(spec, "cross-modal encoder")
            model, tok = self.loaded.model.eval().to(self.device), self.loaded.tokenizer
            self.image_fn = lambda x: model.get_image_features(pixel_values=x)
            self.text_fn = lambda ids, mask: model.get_text_features(input_ids=ids,
                                                                     attention_mask=mask)
            self.length = min(tok.model_max_length, model.config.text_config.max_position_embeddings)
            self.random = self.loaded.random
        else:
            self.loaded = models.load_finetuned(folder, self.device)
            model, tok = self.loaded.model, self.loaded.tokenizer
            self.image_fn, self.text_fn = model.encode_image, model.encode_text
            self.length, self.random = self.loaded.max_length, self.loaded.random
        for p in model.parameters():
            p.requires_grad_(False)
        self.model, self.tokenizer = model, tok
        self.dim = cross_width(spec)

    def pixels(self, data: bytes) -> np.ndarray:
        """Image bytes -> normalised float32 CHW at the model's input size."""
        from vlcurate.foundation.pixels import load_rgb, to_tensor
        size = self.loaded.image_size
        return to_tensor(load_rgb(data, size), size, self.loaded.mean, self.loaded.std,
                         None).numpy()

    def _features(self, out: Any) -> np.ndarray:
        torch = self._torch
        out = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu().numpy()

    @staticmethod
    def _full(x: Any, size: int) -> Any:
        """``x`` padded to ``size`` rows with copies of its last row (fixed compute shapes)."""
        if len(x) == size:
            return x
        idx = list(range(len(x))) + [len(x) - 1] * (size - len(x))
        return [x[i] for i in idx] if isinstance(x, list) else x[idx]

    def encode_pixels(self, pixels: np.ndarray, batch_size: int) -> np.ndarray:
        out = np.zeros((len(pixels), self.dim), np.float32)
        for lo in range(0, len(pixels), batch_size):
            n = min(batch_size, len(pixels) - lo)
            x = self._torch.from_numpy(np.ascontiguousarray(
                self._full(pixels[lo:lo + batch_size], batch_size)))
            with self._torch.inference_mode(), _autocast(self.device, self.dtype):
                out[lo:lo + n] = self._features(self.image_fn(x.to(self.device)))[:n]
        return out

    def encode_images(self, images: Sequence[bytes], batch_size: int) -> np.ndarray:
        if not images:
            return np.zeros((0, self.dim), np.float32)
        return self.encode_pixels(np.stack([self.pixels(b) for b in images]), batch_size)

    def encode_texts(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for lo in range(0, len(texts), batch_size):
            n = min(batch_size, len(texts) - lo)
            t = self.tokenizer(self._full(list(texts[lo:lo + batch_size]), batch_size),
                               padding="max_length", truncation=True, max_length=self.length,
                               return_tensors="pt")
            with self._torch.inference_mode(), _autocast(self.device, self.dtype):
                out[lo:lo + n] = self._features(self.text_fn(
                    t["input_ids"].to(self.device), t["attention_mask"].to(self.device)))[:n]
        return out
