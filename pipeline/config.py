"""Typed, frozen run configuration loaded from YAML (values only; the DAG lives in dag.py).

An unknown key, a wrong type or a bad value is a :class:`ConfigError` that names the dotted key,
e.g. ``ingest.max_pixels: expected int, got 'lots'``.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml


class ConfigError(ValueError):
    pass


class FrozenMap(dict):
    """A read-only, hashable mapping for free-form option values (e.g. a model's kwargs)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(json.dumps(self, sort_keys=True, default=str))

    def __reduce__(self) -> Any:  # pickle through the constructor, not item assignment
        return (FrozenMap, (dict(self),))

    def _ro(self, *a: Any, **k: Any) -> None:
        raise TypeError("config mappings are read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _ro  # type: ignore


# --- sections ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """A model: an id (timm name, Hugging Face repo id, sentence-transformers id) plus an optional
    local path. Loading order: ``path``, else the local cache, else (only with ``allow_download``)
    the hub. ``random_init`` builds the architecture with random weights (tests, demos) and every
    output row says so. ``options``: extra constructor arguments (e.g. a tiny test config)."""
    id: str = ""
    path: Optional[str] = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"   # auto: bf16 on GPU
    device: Literal["auto", "cpu", "cuda"] = "auto"
    random_init: bool = False
    allow_download: bool = False
    options: FrozenMap = FrozenMap()


@dataclass(frozen=True)
class Resources:
    """Ray resources for one stage. ``None`` means "the stage's own default"."""
    num_cpus: Optional[float] = None
    num_gpus: Optional[float] = None
    batch_size: Optional[int] = None     # rows per map_batches call; 0 = a whole part at a time
    concurrency: Optional[int] = None    # actor-pool size (callable-class stages)


@dataclass(frozen=True)
class RunConfig:
    run_dir: str = "runs/default"
    # Heavy stages skip rows already flagged upstream (they get nulls). True computes every
    # ingested row, so that any later export policy finds its annotations.
    compute_on_flagged: bool = False
    progress: bool = True
    # run only these stages of the DAG (ingest and export always run); empty = all of them
    stages: tuple[str, ...] = ()
    # a stage that flags more than this share of the rows it saw prints a WARNING naming its top
    # reason and the setting to turn (console and summary)
    warn_reject_fraction: float = 0.9
    # ... and above this share the run stops after that stage (null: never stop)
    max_reject_fraction: Optional[float] = None

    # Determinism (not resources): a stage is always called on chunks of chunk_rows rows of one
    # part, aligned to the part's first row, whatever resources.batch_size (rounded up to a
    # multiple of it), the concurrency or the executor; and with intra_op_threads torch/BLAS/
    # OpenMP threads. Both change numerics at ~1e-7, so a non-default value enters fingerprints.
    chunk_rows: int = 1024
    intra_op_threads: int = 1

    def __post_init__(self) -> None:
        for name in ("warn_reject_fraction", "max_reject_fraction"):
            v = getattr(self, name)
            if v is not None and isinstance(v, (int, float)) and not 0 <= v <= 1:
                raise ConfigError(f"run.{name}: must be in [0, 1], got {v}")


@dataclass(frozen=True)
class RayConfig:
    # None: $RAY_ADDRESS if set, else an embedded local Ray. "local" forces the embedded one.
    address: Optional[str] = None
    num_cpus: Optional[int] = None       # embedded Ray only
    num_gpus: Optional[int] = None       # embedded Ray only
    # Keep Ray's own per-operator progress bars (vlcurate prints one bar per stage anyway).
    ray_progress_bars: bool = False


@dataclass(frozen=True)
class SourceConfig:
    kind: Literal["folder", "parquet", "webdataset", "img2dataset"] = "folder"
    path: str = ""
    name: Optional[str] = None           # default: the source folder's name
    # folder: a captions CSV or JSONL (relative to path) and the folder the images are in
    captions_file: Optional[str] = None  # default: captions.csv, captions.jsonl or metadata.jsonl
    images_dir: str = "images"           # relative to path; "" = path itself
    image_column: str = "image"          # folder/parquet: file name / path / bytes column
    caption_column: str = "caption"
    key_column: Optional[str] = None     # default: image name (+ "#n" for its n-th caption)
    extra_columns: tuple[str, ...] = ()  # copied into the `extra` JSON column
    max_captions_per_image: Optional[int] = None
    rows_per_part: int = 1000            # folder/parquet: rows per part; tars: one part per tar
    # Untrusted input (the readers see only this section, so the read limit lives here): a file,
    # tar member or Parquet cell over max_image_bytes is rejected (ingest.file_too_large) before
    # it is read; an image path resolving outside source.path is ingest.outside_source unless
    # allowed; a Parquet list<string> caption column is a config error unless caption_list: first.
    max_image_bytes: int = 64 * 1024 * 1024
    allow_outside_source: bool = False
    caption_list: Literal["error", "first"] = "error"


@dataclass(frozen=True)
class IngestConfig:
    max_pixels: int = 89_478_485         # PIL's own bomb threshold; larger headers are rejected
    min_side: int = 8
    max_caption_chars: int = 2048
    # auto: keep the source bytes when they are an RGB JPEG needing no EXIF rotation, else
    # re-encode the decoded RGB image as JPEG; always: always re-encode
    reencode: Literal["auto", "always"] = "auto"
    jpeg_quality: int = 95
    resources: Resources = Resources()


@dataclass(frozen=True)
class IdsConfig:
    resources: Resources = Resources()


# --- stage sections: each plugged-in stage adds its section dataclass here -----------------------
# (values only; a `resources: Resources = Resources()` field lets config override its defaults)
# <<embed section>>
@dataclass(frozen=True)
class EmbedConfig:
    """HELIP's unimodal encoders: DINO ViT-S/8 (CLS token) and a SentenceTransformer."""
    image_model: ModelSpec = ModelSpec(id="vit_small_patch8_224.dino")
    text_model: ModelSpec = ModelSpec(id="sentence-transformers/all-mpnet-base-v2")
    # FFF sec. 4.1: one image-text (CLIP-style, transformers CLIPModel) model for S_it, S_ii and
    # S_tt; null = none (positives then run without Eq. 1's main clause, and the summary says so)
    cross_model: Optional[ModelSpec] = None
    cross_batch_size: int = 64          # images / captions per cross-model forward pass
    image_batch_size: int = 64
    text_batch_size: int = 256
    float16_storage: bool = False
    # decode and preprocess images in `threads` inside the encoder actor, overlapping the model,
    # or in the CPU `tasks` that read each part, ahead of the actor
    decode: Literal["threads", "tasks"] = "threads"
    decode_threads: int = 4
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        if isinstance(self.cross_batch_size, int) and self.cross_batch_size <= 0:
            raise ConfigError(f"embed.cross_batch_size: must be > 0, got {self.cross_batch_size}")


# <<mining section>>
@dataclass(frozen=True)
class HpmConfig:
    """HELIP hard-pair mining (stage ``hpm``); ``positives`` shares its method/search settings."""
    k: int = 100                  # hard pairs per target (HELIP's released code; Table 9 uses 500)
    tau_image: float = 0.5        # HELIP sec. 4.1: tau = 0.5; similarities <= tau count as 0
    tau_text: float = 0.5
    # a pair with S_I or S_T above it is a duplicate: a positive, never a hard pair; null = off
    dup_threshold: Optional[float] = 0.98
    # drop: flag noise pairs with hpm.noise_pair (export drops them, later stages skip them);
    # mark: only the hpm_is_noise column, no reason
    noise_action: Literal["drop", "mark"] = "drop"
    # blocks: one neighbour pass in dense blocks (each cluster x the rows routed to it, exact GEMM);
    # exact: the same pass probing every cluster; auto: exact up to exact_max_n rows, then
    # blocks; fast: FastHPM (FAISS IVF-PQ, legacy: finds no FFF candidate pairs)
    method: Literal["auto", "exact", "blocks", "fast"] = "auto"
    exact_max_n: int = 50_000
    clusters: Optional[int] = None      # blocks: k-means clusters; null = about n / 2048
    # blocks: clusters searched per row (nearest means); 40 of 488 at 1M: recall@k >= 0.99 for
    # k = 5..100 (5..500 at 200k; tests/benchmarks/bench_mining.py); 56 adds < 0.002
    probe: int = 40
    pass_actors: int = 0                # blocks: Ray actors for the pass; 0 = in the global step
    pass_cpus: float = 1.0              # blocks: CPUs per pass actor (its torch threads)
    # candidate pairs kept for the positives stage (its thresholds must not be below these)
    pair_image: float = 0.9             # S_ii > pair_image
    pair_text: float = 0.9              # S_tt > pair_text
    pair_cross: float = 0.24            # S_it > pair_cross (cross-modal embeddings only)
    max_pairs: int = 256                # per row, highest max(S_ii, S_tt, S_it) first
    pool_size: Optional[int] = None     # FastHPM candidate pool C (uniform, seeded); null = all
    nlist: Optional[int] = None         # IVF lists; null = auto (power of 2 near sqrt(C))
    pq_m: Optional[int] = None          # PQ sub-quantizers of the joint vector; null = dim / 2
    pq_nbits: int = 4                   # 4: FAISS fast-scan codes (CPU); 8: plain IVF-PQ (GPU)
    nprobe: Optional[int] = None        # null = auto (max(64, nlist / 16))
    k_prime: Optional[int] = None       # candidates re-scored per target; null = 4 k
    # search uncertified targets again with k' x 4 up to k_prime_max (null = 4 k'): `noise`
    # only those about to be flagged as noise pairs, `all` every uncertified one, `off` none
    widen: Literal["noise", "all", "off"] = "noise"
    k_prime_max: Optional[int] = None
    train_size: Optional[int] = None    # IVF-PQ training sample; null = auto
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"    # torch matmuls and the FAISS index
    block_size: int = 8192              # exact: rows per score block
    query_block: int = 1024             # exact: targets per score block
    build_threads: Optional[int] = None  # threads of the global index build; null = all cores
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        _check_mining("hpm", self, positive=("k", "exact_max_n", "clusters", "probe",
                                             "max_pairs", "pool_size", "nlist", "pq_m",
                                             "nprobe", "k_prime", "k_prime_max", "train_size",
                                             "block_size", "query_block", "build_threads"),
                      unit=("tau_image", "tau_text", "dup_threshold", "pair_image", "pair_text",
                            "pair_cross"))
        if self.pass_actors < 0 or self.pass_cpus <= 0:
            raise ConfigError("hpm.pass_actors must be >= 0 and hpm.pass_cpus > 0")
        if not 1 <= self.pq_nbits <= 16:
            raise ConfigError(f"hpm.pq_nbits: must be in 1..16, got {self.pq_nbits}")


@dataclass(frozen=True)
class PositivesConfig:
    """FFF Eq. 1 positives (+ HELIP duplicates): stage ``positives``."""
    p1: float = 0.27            # S_it > p1 (needs a cross-modal embedding)
    p1_text: float = 0.24       # p1': a text-text positive also needs S_it > p1'
    p2: float = 0.92            # S_ii > p2
    p3: float = 0.99            # S_tt > p3
    duplicates: bool = True     # list HELIP duplicates (hpm.dup_threshold) as positives
    # per row: best relation first, then highest similarity; the rest are cut and counted
    # (positive_count, the stage's info and the run summary)
    max_positives: int = 64
    # FFF sec. 4.3: recaptions per image that join its caption as the k captions (needs
    # embed.cross_model; 0 = sec. 4.1 on the original captions only)
    recaptions: int = 5
    k_prime: int = 64           # fast method: candidates per modality
    nprobe: Optional[int] = None  # fast method; null = auto
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        if isinstance(self.recaptions, int) and self.recaptions < 0:
            raise ConfigError(f"positives.recaptions: must be >= 0, got {self.recaptions}")
        _check_mining("positives", self, positive=("max_positives", "k_prime", "nprobe"),
                      unit=())
        for name in ("p1", "p1_text", "p2", "p3"):   # cosine thresholds
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -1 <= v <= 1):
                raise ConfigError(f"positives.{name}: must be in [-1, 1], got {v!r}")


def _check_mining(section: str, obj: Any, positive: tuple, unit: tuple) -> None:
    for name in positive:
        v = getattr(obj, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"{section}.{name}: must be an int > 0, got {v!r}")
    for name in unit:
        v = getattr(obj, name)
        if v is not None and not (isinstance(v, (int, float)) and 0 <= v <= 1):
            raise ConfigError(f"{section}.{name}: must be in [0, 1], got {v!r}")


# <<lang section>>
@dataclass(frozen=True)
class LangConfig:
    """Language ID (stage ``lang``): flag captions not in the kept languages, before the CAT parse."""
    keep: tuple[str, ...] = ("en",)       # ISO 639-1 codes; DiHT's CAT parse is English
    min_prob: float = 0.5                 # flag when P(caption in one of keep) is below this
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        if isinstance(self.min_prob, (int, float)) and not 0 <= self.min_prob <= 1:
            raise ConfigError(f"lang.min_prob: must be in [0, 1], got {self.min_prob}")
        if not self.keep:
            raise ConfigError("lang.keep: name at least one language (ISO 639-1, e.g. [en]); "
                              "to run without the filter, leave `lang` out of run.stages")


# <<cat section>>
@dataclass(frozen=True)
class CatConfig:
    """DiHT's CAT parse (stage ``cat``): complexity and actions of each caption (spaCy)."""
    # package name, pipeline directory (UD or ClearNLP labels), or auto: the first installed
    # English pipeline (en_core_web_* first)
    spacy_model: str = "auto"
    if_missing: Literal["error", "skip"] = "error"   # skip: run without it, saying so in the output
    n_process: int = 1                    # nlp.pipe processes inside one stage instance
    pipe_batch_size: int = 512            # nlp.pipe batch size
    gemm: Literal["numpy", "blis"] = "numpy"   # thinc dense layers: numpy's BLAS (faster) or BLIS
    min_complexity: int = 1               # keep complexity >= this (-1: no object; C0, C1, ...)
    require_action: bool = True           # keep only captions with an action
    participle_actions: bool = True       # DiHT: "running person" is an attribute and an action
    # lower: parse a Title Case caption ("Bravo Apple Juice") in lower case, since the tagger reads
    # capitalised words as proper nouns, never objects; keep: as written (DiHT)
    title_case: Literal["keep", "lower"] = "keep"
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        for name in ("n_process", "pipe_batch_size"):
            if isinstance(getattr(self, name), int) and getattr(self, name) <= 0:
                raise ConfigError(f"cat.{name}: must be > 0, got {getattr(self, name)}")
        if isinstance(self.min_complexity, int) and self.min_complexity < -1:
            raise ConfigError(f"cat.min_complexity: must be >= -1, got {self.min_complexity}")


@dataclass(frozen=True)
class TextSpotConfig:
    """DiHT's text spotting (stage ``textspot``): OCR, flag text that repeats the caption."""
    backend: Literal["rapidocr", "tesseract", "mmocr"] = "rapidocr"
    if_missing: Literal["error", "skip"] = "error"   # skip: run without it, saying so in the output
    min_conf: float = 0.8                 # DiHT: spotting confidence >= 0.8 ...
    min_chars: int = 5                    # ... and >= 5 characters matching the caption
    max_side: int = 1024                  # images are downscaled to this longer side before OCR
    max_texts: int = 32                   # spotted lines kept per image (best confidence first)
    threads: int = 1                      # OCR threads per stage instance (0: the backend's own)
    tesseract_lang: str = "eng"
    tesseract_psm: int = 11               # page segmentation mode 11: sparse text (scene text)
    mmocr_det: str = "DBNet"
    mmocr_rec: str = "SAR"
    mmocr_det_weights: Optional[str] = None
    mmocr_rec_weights: Optional[str] = None
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        for name in ("min_chars", "max_side", "max_texts"):
            if isinstance(getattr(self, name), int) and getattr(self, name) <= 0:
                raise ConfigError(f"textspot.{name}: must be > 0, got {getattr(self, name)}")
        if isinstance(self.min_conf, (int, float)) and not 0 <= self.min_conf <= 1:
            raise ConfigError(f"textspot.min_conf: must be in [0, 1], got {self.min_conf}")
        if isinstance(self.threads, int) and self.threads < 0:
            raise ConfigError(f"textspot.threads: must be >= 0, got {self.threads}")


# <<recaption section>>
@dataclass(frozen=True)
class RecaptionConfig:
    """FFF's BLIP-2 pseudo-captions (stage ``recaption``): beam search, every beam kept."""
    # weights in model.dtype on GPU (auto: bf16; float16 also works); float32 on CPU
    model: ModelSpec = ModelSpec(id="Salesforce/blip2-opt-2.7b")
    prompt: str = ""                    # "" = plain captioning; e.g. "a photo of"
    prompt_in_caption: bool = False     # prepend the prompt to the stored captions
    num_beams: int = 5                  # FFF: five captions per image, by beam search
    num_return_sequences: int = 5       # <= num_beams; all are kept, best score first
    max_new_tokens: int = 30
    length_penalty: float = 1.0         # sequence score = sum log p / length ** length_penalty
    repetition_penalty: float = 1.0     # 1.0 = off (plain beam search)
    max_repeats: int = 3                # an n-gram (n <= 3) this often back to back: repetitive
    batch_size: int = 16                # images per generate call
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        for name in ("num_beams", "num_return_sequences", "max_new_tokens", "batch_size"):
            if isinstance(getattr(self, name), int) and getattr(self, name) <= 0:
                raise ConfigError(f"recaption.{name}: must be > 0, got {getattr(self, name)}")
        if self.num_return_sequences > self.num_beams:
            raise ConfigError(f"recaption.num_return_sequences: must be <= num_beams "
                              f"({self.num_beams}), got {self.num_return_sequences}")
        if isinstance(self.max_repeats, int) and self.max_repeats < 2:
            raise ConfigError(f"recaption.max_repeats: must be >= 2, got {self.max_repeats}")


@dataclass(frozen=True)
class ConceptsConfig:
    """DiHT concept-distillation targets (stage ``concepts``): WordNet vocabulary from the CAT
    parse, frozen teacher features, linear heads, top-k soft targets per image."""
    # DiHT: SWAG ViT-H/14. torchvision/<name> (+ options.weights) or any timm backbone
    teacher: ModelSpec = ModelSpec(id="torchvision/vit_h_14",
                                   options=FrozenMap({"weights": "IMAGENET1K_SWAG_LINEAR_V1"}))
    teacher_batch_size: int = 64
    wordnet_dir: str = "/usr/share/wordnet"   # WordNet 3.0 dict files (Debian: wordnet-base)
    min_object_count: int = 250         # DiHT: noun synsets in >= 250 images (over LAION)
    min_attribute_count: int = 250
    # an object or attribute vocabulary the thresholds leave empty: stop and name the key to
    # lower (error), or go on with empty targets of that kind, said in the run summary (warn)
    if_empty: Literal["error", "warn"] = "error"
    max_objects: Optional[int] = None   # the most frequent ones; ids are uint16 (<= 65535)
    hypernym_backoff: bool = False      # a rare synset counts as its nearest kept hypernym
    min_sharedness: int = 3             # distinct vocabulary objects an attribute describes
    min_visualness: Optional[float] = 0.6   # held-out AUC of its teacher head; null = off
    max_attributes: Optional[int] = 1200    # DiHT keeps 1200 (by visualness, then sharedness)
    holdout_fraction: float = 0.1       # images held out to measure visualness
    top_k: int = 10                     # DiHT: top-10 objects and attributes per image
    epochs: int = 10
    resample_length: Optional[int] = None   # draws per epoch (DiHT: 50M); null = the images
    batch_size: int = 256               # head training
    base_lr: float = 0.001              # lr = base_lr * batch_size / 256 (linear scaling rule)
    momentum: float = 0.9
    weight_decay: float = 1e-4
    seed: int = 0
    resources: Resources = Resources()

    def __post_init__(self) -> None:
        for name in ("teacher_batch_size", "top_k", "epochs", "batch_size", "max_objects",
                     "max_attributes", "resample_length"):
            v = getattr(self, name)
            if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
                raise ConfigError(f"concepts.{name}: must be > 0, got {v}")
        if isinstance(self.max_objects, int) and self.max_objects > 65535:
            raise ConfigError(f"concepts.max_objects: ids are uint16, at most 65535, got "
                              f"{self.max_objects}")
        for name in ("min_visualness", "holdout_fraction"):
            v = getattr(self, name)
            if isinstance(v, (int, float)) and not 0 <= v < 1:
                raise ConfigError(f"concepts.{name}: must be in [0, 1), got {v}")


# <<finetune section>>
@dataclass(frozen=True)
class FinetuneConfig:
    """The thin DDP trainer over the exported shards (stages/finetune/)."""
    shards: Optional[str] = None         # default: <run_dir>/export/shards
    out_dir: Optional[str] = None        # default: <run_dir>/finetune
    model: ModelSpec = ModelSpec(id="openai/clip-vit-base-patch32")
    loss: Literal["clip", "helip", "hn_nce", "sigmoid", "mp_nce"] = "clip"
    helip_seed_fraction: float = 0.5     # HELIP Alg. 3: the share of B used as seeds B'
    helip_p: int = 1                     # hard pairs drawn per seed (HELIP sec. 4.1: p = 1)
    helip_gamma: float = 1.0             # HNML weight (HELIP sec. 4.1: gamma = 1)
    hn_alpha: float = 1.0                # DiHT Table A.2 (LAION): alpha, beta = 1.0, 0.25
    hn_beta: float = 0.25
    fff_recaptions: int = 5              # recaptions per image added as positives (sigmoid/mp_nce)
    fff_mined_positives: bool = True     # the pipeline's FFF positives enter the mask M
    mp_views: int = 1                    # UniCLIP: augmented views per image (mp_nce only)
    mp_domain_weights: Optional[tuple[float, ...]] = None  # UniCLIP w_D [ii, it, tt]; null = N/#pairs per batch
    clipc_fraction: float = 0.0          # CLIP-C: share of composite samples per batch
    concept_weight: float = 0.0          # DiHT concept distillation (0.5 keeps the paper's balance)
    n_objects: int = 0                   # concept head sizes (0: the run's vocabulary if concept_weight > 0)
    n_attributes: int = 0
    batch_size: int = 32                 # per rank
    steps: int = 100
    lr: float = 1e-5
    weight_decay: float = 0.1
    seed: int = 0
    ckpt_every: int = 50
    eval_fraction: float = 0.05          # share held out for zero-shot retrieval (by sample_id hash)
    eval_seed: int = 0                   # seeds the held-out hash (apart from `seed`: same eval set)
    eval_batch_size: int = 64
    shuffle_buffer: int = 256
    bias_init_batches: int = 2           # FFF sec. 4.4: batches for the sigmoid bias search
    amp: bool = True                     # bf16 autocast on GPU
    nproc: int = 1                       # processes for `vlcurate finetune` (torchrun)
    progress: bool = True                # rank 0's progress bar (loss, samples/s)




@dataclass(frozen=True)
class ExportConfig:
    # fnmatch patterns of reason codes that drop a row; "ingest.*" always drops.
    drop: tuple[str, ...] = ("*",)
    samples_per_shard: int = 10_000
    shard_prefix: str = "shard"
    exclude_columns: tuple[str, ...] = ()  # left out of the annotated table and the shard json
    out_dir: Optional[str] = None          # default: <run_dir>/export
    resources: Resources = Resources()


# Settings that change speed, never output: left out of every fingerprint (like each section's
# `resources`), so that tuning them never reruns a stage. tests/pipeline/test_fingerprint_keys.py
# pins what is in and what is out.
SPEED_ONLY: dict[str, tuple[str, ...]] = {
    "embed": ("decode", "decode_threads"),         # where/how many threads decode (same pixels)
    "hpm": ("build_threads", "pass_actors", "pass_cpus"),   # threads / actors of the search
    "cat": ("n_process", "pipe_batch_size", "gemm"),   # spaCy processes, batches, BLAS kernels
    "textspot": ("threads",),                      # OCR threads
}


@dataclass(frozen=True)
class Config:
    run: RunConfig = RunConfig()
    ray: RayConfig = RayConfig()
    source: SourceConfig = SourceConfig()
    ingest: IngestConfig = IngestConfig()
    ids: IdsConfig = IdsConfig()
    # <<embed field>>
    embed: EmbedConfig = EmbedConfig()
    # <<mining field>>
    hpm: HpmConfig = HpmConfig()
    positives: PositivesConfig = PositivesConfig()
    lang: LangConfig = LangConfig()
    # <<cat field>>
    cat: CatConfig = CatConfig()
    textspot: TextSpotConfig = TextSpotConfig()
    # <<recaption field>>
    recaption: RecaptionConfig = RecaptionConfig()
    concepts: ConceptsConfig = ConceptsConfig()
    # <<finetune field>>
    finetune: FinetuneConfig = FinetuneConfig()
    export: ExportConfig = ExportConfig()

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def replace(self, **overrides: Any) -> "Config":
        """Return a copy with dotted-key overrides applied (``replace(**{"export.drop": []})``)."""
        data = to_dict(self)
        for k, v in overrides.items():
            _set_dotted(data, k, v)
        return from_dict(data)


# --- conversion ----------------------------------------------------------------------------------
def to_dict(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    return obj


def to_json(obj: Any) -> str:
    """Canonical JSON (sorted keys): the input to fingerprints."""
    return json.dumps(to_dict(obj), sort_keys=True, separators=(",", ":"))


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _convert(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of "
                          f"{[_type_name(a) for a in inner]}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        item_tp = args[0]
        return tuple(_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if tp is FrozenMap:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return FrozenMap(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")  # pragma: no cover - a bug in this file


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in defaults:
            close = difflib.get_close_matches(str(k), list(defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(defaults)})"
            raise ConfigError(f"{key}: unknown key{hint}")
        if isinstance(v, dict) and dataclasses.is_dataclass(defaults[k]) and \
                not (isinstance(defaults[k], ModelSpec) and "id" in v):
            # a partial value edits the field's default: `--set embed.image_model.path=X` is the
            # default model's path (a value naming another model id starts from a blank spec)
            v = {**to_dict(defaults[k]), **v}
        kwargs[k] = _convert(v, hints[k], key)
    obj = cls(**kwargs)
    _validate(obj, prefix)
    return obj


_POSITIVE = {"chunk_rows", "intra_op_threads", "rows_per_part", "max_image_bytes",
             "samples_per_shard", "max_pixels", "max_caption_chars", "min_side",
             "image_batch_size", "text_batch_size", "decode_threads"}


def _validate(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in _POSITIVE and isinstance(v, int) and v <= 0:
            raise ConfigError(f"{key}: must be > 0, got {v}")
        if f.name == "jpeg_quality" and not 1 <= v <= 100:
            raise ConfigError(f"{key}: must be in 1..100, got {v}")
        if isinstance(obj, Resources) and v is not None and v < 0:
            raise ConfigError(f"{key}: must be >= 0, got {v}")


def from_dict(data: dict | None) -> Config:
    return _build(Config, data or {}, "")


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    cur = data
    for i, p in enumerate(parts[:-1]):
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])}: is not a section, cannot set {dotted}")
        cur = nxt
    cur[parts[-1]] = value


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["export.drop=[cat.*]", "run.run_dir=/tmp/x"]`` -> {dotted key: YAML-parsed value}."""
    out = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = yaml.safe_load(v) if v.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {k}: cannot parse {v!r}: {e}")
    return out


def load(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}")
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        # a relative source.path is relative to the config file's folder (run_dir: to the cwd)
        src = data.get("source")
        val = src.get("path") if isinstance(src, dict) else None
        if isinstance(val, str) and val and not Path(val).is_absolute() and "://" not in val:
            src["path"] = str((p.parent / val).resolve())
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    for k, v in (overrides or {}).items():
        _set_dotted(data, k, v)
    return from_dict(data)


__all__ = ["Config", "ConfigError", "Resources", "ModelSpec", "FrozenMap", "EmbedConfig", "RunConfig", "RayConfig", "SourceConfig",
           "IngestConfig", "IdsConfig", "ExportConfig", "load", "from_dict", "to_dict", "to_json",
           "parse_overrides", "field"]
