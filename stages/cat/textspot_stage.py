"""DiHT's CAT filter, its second stage: ``textspot`` spots text in each image (OCR) and flags
the rows whose image repeats its caption (``cat.text_spotted``). It runs after ``cat``
(``cat_stage.py``), on the rows the parse kept."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

import pyarrow as pa

from vlcurate.foundation.params import Params, at_least, doc, positive, unit
from vlcurate.schemas import F, conform
from vlcurate.schemas import cat as S
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import Finding, MapStage, Resources, once_per_image, opened
from vlcurate.stages.images import count_again, recording
from vlcurate.foundation.versions import installed
from vlcurate.stages.cache import ImageCache

from . import textspot as T
from . import textspot_runtime as RT
from .optional import decide, skip_status, skipped_table


@dataclass(frozen=True)
class TextSpotParams(Params):
    """DiHT's text spotting (stage ``textspot``): OCR, flag text that repeats the caption."""
    backend: Literal["rapidocr", "tesseract", "mmocr"] = doc("rapidocr", "the OCR engine")
    mode: Literal["fast", "cascade", "full"] = doc("full", (
        "rapidocr: full: the full OCR, every line it reads; cascade (cheaper) skips images its "
        "gate finds no line in and stops at a match: fewer lines recorded, and it may miss a "
        "decision; fast: at det_pixels (docs/textspot.md)"))
    det_pixels: int = positive(196_608, doc=(
        "fast: the text detector's input size in pixels (~512 x 384)"))
    gate_pixels: int = at_least(0, 0, doc="fast: a first, cheaper text detection at this size; "
                                "an image where it finds no box is done (0: off)")
    gate: bool = doc(True, (
        "cascade: the gate; false: every image gets the full OCR's detection (cheaper where "
        "nearly every image holds text: product packs)"))
    gate_min_pixels: int = positive(196_608, doc=(
        "cascade: the gate's least size in pixels (65,536: ~1.5-2.7x faster on photo sets, "
        "misses blurred small text on product packs)"))
    stop_early: bool = doc(True, (
        "cascade: stop reading an image once a line repeats each of its captions (the same "
        "decisions; ocr_texts then lists the lines read up to the row's match)"))
    keep_texts: bool = doc(False, "fast, cascade: recognise every box, so ocr_texts lists "
                                  "every line read (cascade: the full OCR)")
    device: Literal["cpu", "cuda"] = doc("cpu", "rapidocr's onnxruntime device (cuda needs "
                                                "onnxruntime-gpu)")
    runtime: Literal["auto", "onnxruntime", "openvino"] = doc("auto", (
        "what runs rapidocr's models on a CPU: auto is openvino when it imports (cuda: always "
        "onnxruntime)"))
    precision: Literal["f32", "bf16"] = doc("f32", (
        "openvino: the models' precision (f32: the full OCR's lines; bf16: ~1.5x cheaper with "
        "AMX, but some reads change: 97.5% of product-pack decisions kept; it runs f32 where the "
        "CPU has no bf16)"))
    if_missing: Literal["error", "skip"] = doc("error", "no OCR backend: stop (error), or run "
                                                        "without it, saying so")
    min_conf: float = unit(0.8, doc="DiHT: a spotted line needs this OCR confidence ...")
    min_chars: int = positive(5, doc="... and this many letters or digits in common with the "
                                     "caption")
    max_side: int = positive(1024, doc="images are downscaled to this longer side before OCR")
    max_texts: int = positive(32, doc="spotted lines kept per image, best confidence first")
    threads: int = at_least(1, 0, doc="OCR threads per stage instance; 0: the backend's own")
    tesseract_lang: str = doc("eng", "tesseract's language")
    tesseract_psm: int = doc(11, "tesseract's page segmentation mode (11: sparse text, scene "
                                 "text)")
    mmocr_det: str = doc("DBNet", "mmocr's text detector")
    mmocr_rec: str = doc("SAR", "mmocr's text recogniser")
    mmocr_det_weights: Optional[str] = doc(None, "the detector's weights file; null: mmocr's "
                                                 "own download")
    mmocr_rec_weights: Optional[str] = doc(None, "the recogniser's weights file; null: mmocr's "
                                                 "own download")
    resources: Resources = Resources()


def _cache_key(c: TextSpotParams) -> dict:
    """What one image's spotted lines depend on (the cache's namespace): the backend as
    installed, the downscale size and that backend's own settings; not the thresholds."""
    own = {"tesseract": (c.tesseract_lang, c.tesseract_psm),
           "mmocr": (c.mmocr_det, c.mmocr_rec, c.mmocr_det_weights, c.mmocr_rec_weights),
           "rapidocr": (repr(_reads(c)), c.device, runtime(c))}
    return {"backend": T.backend_identity(c), "max_side": c.max_side,
            "settings": own.get(c.backend, ()),
            "libraries": installed("pillow", "onnxruntime", "numpy")}  # decode, OCR runtime


def _reads(c: TextSpotParams) -> Any:
    """``textspot.mode``'s settings, less the confidence at which a cascade stops reading: a
    read that stopped is used only for the rows its lines settle (``T.seen_by``), whatever the
    threshold, so it is valid for any."""
    fast = T.fast_path(c)
    return dataclasses.replace(fast, stop_conf=0.0) if isinstance(fast, T.Cascade) else fast


def runtime(c: TextSpotParams) -> str:
    """What runs rapidocr's models, as it will run (``auto`` resolved), with its precision."""
    return RT.identity(c.runtime, c.device, c.precision) if c.backend == "rapidocr" else ""


def _encode(pair: tuple) -> Any:
    spots = [[s.text, s.conf] for s in pair[0]]
    return {"read": spots, "complete": pair[0].complete} if isinstance(pair[0], T.Read) else spots


def _decode(value: Any) -> tuple:
    if isinstance(value, dict):
        return T.Read([T.Spot(t, conf) for t, conf in value["read"]], value["complete"]), None
    return [T.Spot(text, conf) for text, conf in value], None


def _keep(pair: tuple) -> bool:
    """Only an image OCR read is cached; one that failed is tried again next time."""
    return pair[0] is not None and pair[1] is None


class TextSpotStage(MapStage):
    """OCR text that repeats the caption (``cat.text_spotted``)."""
    name = "textspot"
    version = "5"
    Params = TextSpotParams
    speed_only = ("threads",)             # OCR threads
    inputs = {"ingest": (F.CAPTION, F.IMAGE, F.IMAGE_HASH)}
    output = S.TEXTSPOT
    resources = Resources(num_cpus=1, batch_size=64)
    on_actors = True
    image_homes = True
    expected_reject = 0.30    # text in the image that repeats the caption
    knobs = {R.CAT_TEXT_SPOTTED: "textspot.min_chars / textspot.min_conf"}

    @classmethod
    def preflight(cls, config: Any, stages: frozenset[str]) -> list[Finding]:
        t = config.textspot
        return [opened("textspot.backend", t.if_missing,
                       lambda: (T.make_backend(t), T.backend_identity(t))[1],
                       (T.BackendUnavailable,))]

    @classmethod
    def environment(cls, config: Any) -> dict:
        """What the output depends on beyond config (for the runner's fingerprint)."""
        c = config.textspot
        return {"ocr_backend": T.backend_identity(c), **({"ocr_runtime": runtime(c)}
                                                         if c.backend == "rapidocr" else {})}

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        """A runtime or precision other than the config's (``RT.fallbacks``)."""
        c = config.textspot
        return [f"textspot: {x}" for x in RT.fallbacks(c.runtime, c.device, c.precision)] \
            if c.backend == "rapidocr" else []

    def setup(self) -> None:
        c = self.config.textspot
        self.ocr, self.skipped = decide(lambda: T.make_backend(c), c.if_missing,
                                         f"text spotting ({c.backend})")
        # mmocr batches the images it is given (its results depend on the batch): not cached;
        # the stage's version is in the namespace: a new version reads images anew
        self.cache = None if c.backend == "mmocr" else ImageCache.of(
            self.config.run, self.name, {"version": self.version, **_cache_key(c)},
            encode=_encode, decode=_decode, keep=_keep)

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column(F.SAMPLE_ID.name)
        if self.ocr is None:
            return skipped_table(ids, S.TEXTSPOT_SKIPPED, self.skipped, S.TEXTSPOT)
        c = self.config.textspot
        # each distinct image is read once (COCO, Flickr: five captions per image) for all its
        # captions; the match is per caption
        images, caps = batch.column(F.IMAGE.name).to_pylist(), \
            [x or "" for x in batch.column(F.CAPTION.name).to_pylist()]
        wanted: dict = {}
        for b, cap in zip(images, caps):
            wanted.setdefault(b, []).append(cap)

        def read(ims: list) -> list:
            # the home pass reads for the image's rows in every part: no early stop
            caps = None if recording() else [wanted[b] for b in ims]
            return list(zip(*T.spot_all(self.ocr, ims, c.max_side, caps)))
        pairs = once_per_image(images, read, self.cache,
                               batch.column(F.IMAGE_HASH.name).to_pylist())
        spots, errors = self._seen(images, caps, pairs, read)
        spots = [None if s is None else sorted(s, key=lambda x: -x.conf)[:c.max_texts]
                 for s in spots]
        ms = [T.best_match(s or [], cap, c.min_conf) for s, cap in zip(spots, caps)]
        hit = [T.text_spotted(m, c.min_chars) for m in ms]
        return conform(pa.table({
            F.SAMPLE_ID.name: ids,
            S.OCR_TEXTS.name: [None if s is None else [x.text for x in s] for s in spots],
            S.OCR_CONFS.name: pa.array([None if s is None else [x.conf for x in s] for s in spots],
                                       S.OCR_CONFS.type),
            S.OCR_MATCH_CHARS.name: pa.array([None if s is None else m.chars
                                              for s, m in zip(spots, ms)], pa.int16()),
            S.OCR_MATCH.name: [m.match for m in ms],
            S.OCR_MATCH_CONF.name: pa.array([m.conf for m in ms], pa.float32()),
            S.TEXTSPOT_SKIPPED.name: errors,
            F.REASONS.name: pa.array([[R.CAT_TEXT_SPOTTED] if h else [] for h in hit],
                                     F.REASONS.type),
            F.REASON_DETAIL.name: pa.array(
                [f"spotted {m.text!r} (conf {m.conf:.2f}) repeats {m.chars} characters of the "
                 f"caption ({m.match!r})" if h else None for m, h in zip(ms, hit)], pa.string())}),
            S.TEXTSPOT)

    def _seen(self, images: list, caps: list, pairs: list, read: Any) -> tuple[list, list]:
        """Per row, the spots it sees (``T.seen_by``) and the error note; an image whose cached
        read stopped before settling a row's caption is read again for its captions."""
        c = self.config.textspot
        seen = [None if s is None else T.seen_by(s, cap, c.min_conf, c.min_chars, c.max_texts)
                for (s, _), cap in zip(pairs, caps)]
        todo = list(dict.fromkeys(b for b, s, p in zip(images, seen, pairs)
                                  if s is None and p[0] is not None))
        again = dict(zip(todo, read(todo))) if todo else {}
        count_again(type(self).__name__, len(todo))
        for i, b in enumerate(images):
            if b in again:
                pairs[i] = again[b]
                seen[i] = None if pairs[i][0] is None else T.seen_by(
                    pairs[i][0], caps[i], c.min_conf, c.min_chars, c.max_texts)
        return seen, [p[1] for p in pairs]

    @classmethod
    def finalize(cls, config: Any, ctx: Any) -> dict:
        return skip_status(ctx, TextSpotStage.name, S.TEXTSPOT_SKIPPED.name)
