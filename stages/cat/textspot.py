"""DiHT's text spotting (paper sec. 3.1): OCR the image, and flag the pair when a confidently
spotted text repeats part of the caption.

The rule (DiHT): "spotting confidence of at least 0.8 and at least 5 predicted characters matching
the caption in a sliding window". Made precise here:

* each spotted text line is matched on its own (lines are never glued together);
* both sides are normalised: Unicode NFKC, ``str.casefold`` (case-insensitive), and every character
  that is not a letter or a digit (``str.isalnum``) removed, so whitespace and punctuation neither
  count nor break a match ("OATLY." matches "Oatly", "COCA-COLA" matches "Coca Cola"); accents are
  kept;
* matched characters = the length of the longest common substring of the two normalised strings;
  a window of ``min_chars`` consecutive spotted characters that occurs in the caption is exactly a
  common substring of that length, so the rule is ``conf >= min_conf and matched >= min_chars``;
* the row records the best line: most matched characters among confident lines, ties to the higher
  confidence.

Backends turn a list of RGB PIL images into, per image, a list of ``Spot(text, conf)`` with ``conf``
in [0, 1]: ``rapidocr`` (the default; PP-OCRv4 ONNX models shipped in its wheel; conf = recognition
score of a line), ``tesseract`` (pytesseract + Debian tesseract-ocr; words grouped into lines,
conf = character-weighted mean of the word confidences / 100) and ``mmocr`` (optional adapter;
conf = recognition score).
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import time
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from PIL import Image

from . import textspot_runtime as R


@dataclass(frozen=True)
class Spot:
    text: str
    conf: float


@dataclass(frozen=True)
class Match:
    chars: int = 0                 # matched characters (longest common normalised substring)
    match: Optional[str] = None    # that substring
    conf: Optional[float] = None   # confidence of the line it came from
    text: Optional[str] = None     # the spotted line


class Read(list):
    """One image's spots in the order they were read (``Cascade`` with ``stop_chars``);
    ``complete`` is False when reading stopped once every caption given was matched."""

    def __init__(self, spots: Sequence[Spot] = (), complete: bool = True) -> None:
        super().__init__(spots)
        self.complete = complete


# the OCR backend cannot run here (the message says what to install or change); defined with the
# runtimes, which raise it too, so that this module imports them and never the other way
BackendUnavailable = R.BackendUnavailable


# --- the matching rule ----------------------------------------------------------------------------
def normalize(text: str) -> str:
    """NFKC, casefold, letters and digits only."""
    return "".join(c for c in unicodedata.normalize("NFKC", text or "").casefold() if c.isalnum())


def longest_common(a: str, b: str) -> str:
    """Longest substring of ``a`` that occurs in ``b`` (the first such, scanning ``a``)."""
    best = ""
    for i in range(len(a)):
        n = len(best) + 1
        while i + n <= len(a) and a[i:i + n] in b:
            best = a[i:i + n]
            n += 1
    return best


def best_match(spots: Sequence[Spot], caption: str, min_conf: float) -> Match:
    cap = normalize(caption)
    best = Match()
    for s in spots:
        if s.conf < min_conf:
            continue
        m = longest_common(normalize(s.text), cap)
        if len(m) > best.chars or (m and len(m) == best.chars and s.conf > (best.conf or 0.0)):
            best = Match(len(m), m, s.conf, s.text)
    return best


def text_spotted(m: Match, min_chars: int) -> bool:
    return m.chars >= min_chars


def repeats(s: Spot, cap: str, min_conf: float, min_chars: int) -> bool:
    """Does the spot ``s`` flag the normalised caption ``cap`` on its own?"""
    return s.conf >= min_conf and len(longest_common(normalize(s.text), cap)) >= min_chars


def seen_by(spots: Sequence[Spot], caption: str, min_conf: float, min_chars: int,
            max_texts: int) -> Optional[list[Spot]]:
    """The spots a row with ``caption`` sees. A ``Read`` of at most ``max_texts`` spots: those
    read up to the first that flags the caption (all, if none does), so the row depends on its
    image and caption only, not on the other captions its image was read for; None when the
    read stopped before either is known. Any other list: all of it."""
    if not isinstance(spots, Read) or (spots.complete and len(spots) > max_texts):
        return list(spots)
    cap = normalize(caption)
    for i, s in enumerate(spots):
        if repeats(s, cap, min_conf, min_chars):
            return list(spots[:i + 1])
    return list(spots) if spots.complete else None


# --- images ---------------------------------------------------------------------------------------
def load_image(data: bytes, max_side: int) -> Image.Image:
    """Decode to RGB, downscaled so that its longer side is at most ``max_side`` (JPEG draft mode
    decodes big photos at a reduced scale directly)."""
    im = Image.open(io.BytesIO(data))
    if im.format == "JPEG" and max(im.size) > max_side:
        im.draft("RGB", (max_side, max_side))
    im = im.convert("RGB")
    if max(im.size) > max_side:
        im.thumbnail((max_side, max_side), Image.BILINEAR)
    return im


# --- backends -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FastPath:
    """What the rule needs of rapidocr (``textspot.mode=fast``): the detector runs once per image at
    a bounded size (``det_pixels``), and only the boxes that could hold ``min_chars`` characters
    are recognised (a crop narrower than ``min_ratio`` times its height cannot); ``tight``: each
    crop is recognised at its own width instead of padded to its batch's widest (and at least
    320 px): ~3.5x less recogniser work, the same decisions (``bench_textspot.py``);
    ``gate_pixels`` (0: off): a cheaper detection at that size first, and an image where it finds
    no box is done (most photos hold no text), so ``det_pixels`` can be larger for the rest."""
    det_pixels: int = 196_608
    min_ratio: float = 0.0
    tight: bool = False
    gate_pixels: int = 0


@dataclass(frozen=True)
class Cascade:
    """``textspot.mode=cascade``: the full OCR's decisions at a fraction of its cost.

    A gate first: the text detector on the image at ``gate_scale`` of its size (side by side; at
    least ``gate_min_pixels``, as the full OCR scales small images up and sees their small,
    blurred text: a 348 px product photo's at 196,608 pixels, not at 65,536). An image passes
    when its probability map above ``gate_level`` (the detector's own threshold) holds a region
    whose rotated box is at least ``gate_length`` pixels long and ``gate_ratio`` times as long
    as wide: a line of several characters. An image it stops is done (no spots; most photos hold
    no text; ``gate`` False: no gate, every image passes). An image it passes gets the full
    OCR's own detection, crops and angle classifier, and its recogniser on the crops that can
    hold the rule's text (``min_ratio``), each padded as its batch in the full OCR pads it
    (``tight``: at its own width). The crops are read ``read_batch`` at a time (one: no more CPU
    than in sixes, measured), widest first; with ``stop_chars`` (0: off) and the image's
    captions, reading stops once every caption is repeated by a line (``repeats`` at
    ``stop_conf``) if the image has at most ``stop_within`` crops (``seen_by``: each row's
    decision is the complete read's)."""
    gate: bool = True
    gate_scale: float = 0.7
    gate_min_pixels: int = 196_608
    gate_level: float = 0.3
    gate_length: float = 4.0
    gate_ratio: float = 0.0
    min_ratio: float = 0.0
    tight: bool = False
    stop_chars: int = 0
    stop_conf: float = 0.8
    stop_within: int = 32
    read_batch: int = 1


class RapidOcrBackend:
    name = "rapidocr"

    def __init__(self, threads: int = 1, fast: Optional[FastPath | Cascade] = None,
                 device: str = "cpu", runtime: str = "onnxruntime", precision: str = "f32"
                 ) -> None:
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:
            raise BackendUnavailable(f"textspot.backend=rapidocr: cannot import "
                                     f"rapidocr_onnxruntime ({e}); `pip install 'vlcurate[ocr]'` "
                                     "or `pip install rapidocr-onnxruntime`") from e
        kw = {"intra_op_num_threads": threads, "inter_op_num_threads": 1} if threads > 0 else {}
        if device == "cuda":
            check_cuda()
            kw.update(det_use_cuda=True, cls_use_cuda=True, rec_use_cuda=True)
        self.ocr, self.fast = RapidOCR(**kw), fast
        self.runtime = R.resolve(runtime, device)
        if self.runtime == "openvino":      # the same models; only the sessions change
            R.use_openvino(self.ocr, threads, precision)
        self.spent: Optional[dict] = None     # the cascade's CPU seconds per step (benchmarks)

    @property
    def reads_captions(self) -> bool:
        """Does a call stop reading an image once its captions are matched (``captions``)?"""
        return isinstance(self.fast, Cascade) and self.fast.stop_chars > 0

    def __call__(self, images: Sequence[Image.Image],
                 captions: Optional[Sequence[Sequence[str]]] = None) -> list[list[Spot]]:
        if isinstance(self.fast, Cascade):
            return [rapid_cascade(self.ocr, im, self.fast, self.spent,
                                  captions[i] if captions else None)
                    for i, im in enumerate(images)]
        if self.fast is not None:
            return [rapid_fast(self.ocr, im, self.fast) for im in images]
        return [rapid_full(self.ocr, im) for im in images]


def check_cuda() -> None:
    import onnxruntime
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        raise BackendUnavailable("textspot.device=cuda: onnxruntime has no CUDA provider here "
                                 f"({onnxruntime.get_available_providers()}): `pip install "
                                 "onnxruntime-gpu` in place of onnxruntime, or textspot.device=cpu")


def rapid_full(ocr: Any, im: Image.Image) -> list[Spot]:
    """rapidocr's full OCR (``RapidOCR.__call__``) step by step: its lines, texts, scores and
    order, the same bytes (tested against it); only the detector's input is normalised through
    a table (``full_detect``), which spares a float64 pass over every pixel."""
    img, _, _ = ocr.preprocess(ocr.load_img(im))
    img, _ = ocr.maybe_add_letterbox(img, {})
    boxes = full_detect(ocr, img)
    if not len(boxes):
        return []
    crops = ocr.text_cls(ocr.get_crop_img_list(img, boxes))[0]
    return [Spot(str(r[0]), float(r[1])) for r in ocr.text_rec(crops)[0]
            if float(r[1]) >= ocr.text_score]


def rapid_fast(ocr: Any, im: Image.Image, fast: FastPath) -> list[Spot]:
    """rapidocr's own steps (decode, detector, crops, classifier, recogniser, its score floor), with
    the detector at ``fast.det_pixels`` and the crops that cannot hold the rule's text left out."""
    img, _, _ = ocr.preprocess(ocr.load_img(im))
    img, _ = ocr.maybe_add_letterbox(img, {})
    if fast.gate_pixels and not len(detect(ocr.text_det, img, fast.gate_pixels)):
        return []
    boxes = detect(ocr.text_det, img, fast.det_pixels)
    crops = [c for c in ocr.get_crop_img_list(img, boxes)
             if c.shape[1] >= fast.min_ratio * c.shape[0]]
    if not crops:
        return []
    crops = ocr.text_cls(crops)[0]
    read = [recognise_tight(ocr.text_rec, c) for c in crops] if fast.tight else \
        ocr.text_rec(crops)[0]
    return [Spot(str(r[0]), float(r[1])) for r in read if float(r[1]) >= ocr.text_score]


def rapid_cascade(ocr: Any, im: Image.Image, c: Cascade, spent: Optional[dict] = None,
                  captions: Optional[Sequence[str]] = None) -> list[Spot]:
    """The cascade (``Cascade``) on one image; ``spent`` (optional) adds up the CPU seconds of
    each step (gate, det with the crops, cls, rec) and counts the images and those passed."""
    clock = Clock(spent)
    img, _, _ = ocr.preprocess(ocr.load_img(im))
    img, _ = ocr.maybe_add_letterbox(img, {})
    passed = gate(ocr.text_det, img, c) if c.gate else True
    clock("gate")
    clock.count("images", 1)
    clock.count("passed", int(passed))
    if not passed:
        return Read() if c.stop_chars else []
    boxes = full_detect(ocr, img)
    crops = ocr.get_crop_img_list(img, boxes) if len(boxes) else []
    widths = full_rec_widths(ocr.text_rec, crops)
    keep = [i for i, x in enumerate(crops) if x.shape[1] >= c.min_ratio * x.shape[0]]
    clock("det")
    left = {normalize(x) for x in captions or ()} if c.stop_chars and \
        len(keep) <= c.stop_within else set()
    out = read_crops(ocr, [crops[i] for i in keep], [widths[i] for i in keep], c, left, clock)
    return out if c.stop_chars else list(out)


def read_crops(ocr: Any, crops: list, widths: list[float], c: Cascade, left: set[str],
               clock: "Clock") -> Read:
    """The angle classifier and the recogniser on ``crops`` (``reading_order``); with captions
    ``left`` (normalised), the reading stops once a line repeats each."""
    out = Read()
    parts = reading_order(crops, widths, c.read_batch)
    for n, idx in enumerate(parts):
        part = ocr.text_cls([crops[i] for i in idx])[0]
        clock("cls")
        read = [recognise_tight(ocr.text_rec, x) for x in part] if c.tight else \
            recognise_padded(ocr.text_rec, part, [widths[i] for i in idx])
        clock("rec")
        spots = [Spot(str(r[0]), float(r[1])) for r in read if float(r[1]) >= ocr.text_score]
        out.extend(spots)
        had = bool(left)
        left = {x for x in left if not any(repeats(s, x, c.stop_conf, c.stop_chars)
                                           for s in spots)}
        if had and not left:
            out.complete = n == len(parts) - 1
            return out
    return out


def reading_order(crops: list, widths: list[float], size: int) -> list[list[int]]:
    """The crops' indices in the order they are read, in batches of at most ``size`` of one
    padded width: the widest first (by padded width, then by their own)."""
    order = sorted(range(len(crops)), key=lambda i: (-widths[i],
                                                     -crops[i].shape[1] / crops[i].shape[0], i))
    parts: list[list[int]] = []
    for i in order:
        if parts and len(parts[-1]) < size and widths[parts[-1][0]] == widths[i]:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts


class Clock:
    """Adds the CPU seconds since the last call to ``spent[step]`` (nothing when ``spent`` is
    None)."""

    def __init__(self, spent: Optional[dict]) -> None:
        self.spent, self.t = spent, time.process_time()

    def __call__(self, step: str) -> None:
        if self.spent is not None:
            now = time.process_time()
            self.count(step, now - self.t)
            self.t = now

    def count(self, key: str, n: float) -> None:
        if self.spent is not None:
            self.spent[key] = self.spent.get(key, 0) + n


def gate(det: Any, img: Any, c: Cascade) -> bool:
    """May ``img`` hold a line of text? (``Cascade``'s gate.)"""
    import cv2
    import numpy as np
    pixels = max(round(c.gate_scale ** 2 * img.shape[0] * img.shape[1]), c.gate_min_pixels)
    mask = (det_map(det, img, pixels)[0, 0] > c.gate_level).astype(np.uint8)
    for region in cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)[0]:
        long, short = sorted(cv2.minAreaRect(region)[1], reverse=True)
        if long >= c.gate_length and long >= c.gate_ratio * short:
            return True
    return False


def full_detect(ocr: Any, img: Any) -> list:
    """The full OCR's text detection (``RapidOCR.auto_text_det``): its own input size and steps
    (``det_input``: the same float32 inputs without a float64 pass over every pixel); boxes top
    to bottom."""
    det = ocr.text_det
    pre = det.get_preprocess(max(img.shape[0], img.shape[1]))
    resized = pre.resize(img)
    if resized is None:
        return []
    boxes, _ = det.postprocess_op(det.infer(det_input(pre, resized))[0], img.shape[:2])
    boxes = det.filter_tag_det_res(boxes, img.shape[:2])
    return ocr.sorted_boxes(boxes) if len(boxes) else []


def det_input(pre: Any, resized: Any) -> Any:
    """The detector's input from a resized uint8 image, as ``pre`` (rapidocr's ``DetPreProcess``)
    normalises it, read from a table of the 256 values (1, 3, height, width)."""
    import numpy as np
    table = pre.normalize(np.repeat(np.arange(256, dtype=np.uint8)[:, None, None], 3, 2))
    table = table[:, 0, :].astype(np.float32)
    x = np.empty((1, 3) + resized.shape[:2], np.float32)
    for ch in range(3):
        np.take(table[:, ch], resized[:, :, ch], out=x[0, ch])
    return x


def full_rec_widths(rec: Any, crops: Sequence[Any]) -> list[float]:
    """Per crop, the width / height ratio the full OCR pads it to: its recogniser sorts the crops
    by aspect ratio (``np.argsort``, as it does) and pads each batch of ``rec_batch_num`` to the
    batch's widest, at least ``rec_img_shape``'s."""
    import numpy as np
    ratios = [x.shape[1] / float(x.shape[0]) for x in crops]
    order = np.argsort(np.array(ratios))
    _, h, w = rec.rec_image_shape[:3]
    out = [0.0] * len(crops)
    for beg in range(0, len(crops), rec.rec_batch_num):
        batch = order[beg:beg + rec.rec_batch_num]
        widest = max([w / h] + [ratios[i] for i in batch])
        for i in batch:
            out[i] = widest
    return out


def recognise_padded(rec: Any, crops: Sequence[Any], widths: Sequence[float]) -> list:
    """rapidocr's recogniser on ``crops``, each padded to its ``widths`` ratio (the crops of one
    width in one batch): (text, score) per crop, in order."""
    import numpy as np
    out: list = [None] * len(crops)
    for width in sorted(set(widths)):
        idx = [i for i, x in enumerate(widths) if x == width]
        x = np.stack([rec.resize_norm_img(crops[i], width) for i in idx]).astype(np.float32)
        for i, r in zip(idx, rec.postprocess_op(rec.session(x)[0])):
            out[i] = r
    return out


def recognise_tight(rec: Any, crop: Any) -> tuple:
    """rapidocr's recogniser on one crop, 48 px high at its own aspect ratio (the width padded with
    zeros to a multiple of 8, the recogniser's stride): (text, score)."""
    import cv2
    import numpy as np
    h, w = crop.shape[:2]
    width = max(1, math.ceil(48 * w / h))
    x = np.zeros((1, 3, 48, -(-width // 8) * 8), np.float32)
    x[0, :, :, :width] = (cv2.resize(crop, (width, 48)).astype(np.float32).transpose(2, 0, 1)
                          / 255.0 - 0.5) / 0.5
    return rec.postprocess_op(rec.session(x)[0])[0]


def det_map(det: Any, img: Any, pixels: int) -> Any:
    """rapidocr's text detector (DBNet) on ``img`` scaled (up or down) to about ``pixels`` pixels,
    each side a multiple of 32: its probability map, (1, 1, height, width)."""
    import cv2
    h, w = img.shape[:2]
    scale = (pixels / (h * w)) ** 0.5
    size = (max(32, round(w * scale / 32) * 32), max(32, round(h * scale / 32) * 32))
    return det.infer(det_input(det.get_preprocess(0), cv2.resize(img, size)))[0]


def detect(det: Any, img: Any, pixels: int) -> list:
    """rapidocr's text detector (DBNet) at about ``pixels`` pixels (``det_map``); boxes in
    ``img``'s pixels, top to bottom."""
    from rapidocr_onnxruntime import RapidOCR
    h, w = img.shape[:2]
    boxes, _ = det.postprocess_op(det_map(det, img, pixels), (h, w))
    boxes = det.filter_tag_det_res(boxes, (h, w))
    return RapidOCR.sorted_boxes(boxes) if len(boxes) else []


class TesseractBackend:
    name = "tesseract"

    def __init__(self, lang: str = "eng", psm: int = 11, threads: int = 1) -> None:
        try:
            import pytesseract
        except ImportError as e:
            raise BackendUnavailable(f"textspot.backend=tesseract: cannot import pytesseract "
                                     f"({e}); `pip install pytesseract`") from e
        cmd = pytesseract.pytesseract.tesseract_cmd
        if not shutil.which(cmd):
            raise BackendUnavailable(f"textspot.backend=tesseract: the tesseract binary "
                                     f"({cmd!r}) is not installed: `apt-get install "
                                     "tesseract-ocr tesseract-ocr-eng` (or use "
                                     "textspot.backend=rapidocr)")
        missing = [x for x in lang.split("+") if x not in pytesseract.get_languages(config="")]
        if missing:
            raise BackendUnavailable(f"textspot.tesseract_lang={lang!r}: tesseract has no data for "
                                     f"{missing}: `apt-get install tesseract-ocr-{missing[0]}`")
        self.tess, self.config, self.lang, self.threads = pytesseract, f"--psm {psm}", lang, threads

    def __call__(self, images: Sequence[Image.Image]) -> list[list[Spot]]:
        with omp_limit(self.threads):
            return [tesseract_lines(self.tess.image_to_data(
                im, lang=self.lang, config=self.config, output_type=self.tess.Output.DICT))
                for im in images]


@contextlib.contextmanager
def omp_limit(threads: int):
    """tesseract's OpenMP threads, through the environment its process inherits, set only while
    it runs: left in this process's environment, OMP_THREAD_LIMIT would reach every process
    started later (a Ray worker, a torch subprocess), whose kernels it changes."""
    if threads <= 0:
        yield
        return
    old = os.environ.get("OMP_THREAD_LIMIT")
    os.environ["OMP_THREAD_LIMIT"] = str(threads)
    try:
        yield
    finally:
        if old is None:
            del os.environ["OMP_THREAD_LIMIT"]
        else:
            os.environ["OMP_THREAD_LIMIT"] = old


def tesseract_lines(data: dict) -> list[Spot]:
    """Words of ``pytesseract.image_to_data`` grouped into lines (block, paragraph, line); a line's
    conf is the character-weighted mean of its words' confidences (0-100) / 100."""
    lines: dict[tuple, list[tuple[str, float]]] = {}
    for i, word in enumerate(data["text"]):
        conf = float(data["conf"][i])
        if not str(word).strip() or conf < 0:
            continue
        key = (data["block_num"][i], data["par_num"][i], data["line_num"][i])
        lines.setdefault(key, []).append((str(word).strip(), conf))
    out = []
    for words in lines.values():
        n = sum(len(w) for w, _ in words)
        out.append(Spot(" ".join(w for w, _ in words), sum(len(w) * c for w, c in words) / n / 100))
    return out


class MmocrBackend:
    """Adapter for mmocr 1.x's ``MMOCRInferencer`` (not installable on current torch: mmcv has no
    wheels; bring your own mmocr, mmcv and weights)."""
    name = "mmocr"

    def __init__(self, det: str = "DBNet", rec: str = "SAR", det_weights: Optional[str] = None,
                 rec_weights: Optional[str] = None, device: Optional[str] = None) -> None:
        try:
            from mmocr.apis import MMOCRInferencer
        except Exception as e:  # noqa: BLE001 - mmcv fails in many ways (ImportError, OSError)
            raise BackendUnavailable(
                f"textspot.backend=mmocr: cannot import mmocr ({type(e).__name__}: {e}); mmocr "
                "needs mmcv, which has no wheels for current torch: build mmcv and install mmocr "
                "yourself (https://mmocr.readthedocs.io), or use textspot.backend=rapidocr or "
                "tesseract") from e
        self.infer = MMOCRInferencer(det=det, det_weights=det_weights, rec=rec,
                                     rec_weights=rec_weights, device=device)

    def __call__(self, images: Sequence[Image.Image]) -> list[list[Spot]]:
        import numpy as np
        bgr = [np.ascontiguousarray(np.asarray(im)[:, :, ::-1]) for im in images]
        out = self.infer(bgr, batch_size=len(bgr), out_dir="", return_vis=False)
        return [mmocr_spots(p) for p in out["predictions"]]


def mmocr_spots(pred: dict) -> list[Spot]:
    """One image's ``MMOCRInferencer`` prediction (rec_texts, rec_scores) as spots."""
    return [Spot(str(t), float(s)) for t, s in zip(pred.get("rec_texts", []),
                                                    pred.get("rec_scores", []))]


BACKENDS: dict[str, Callable[..., Any]] = {"rapidocr": RapidOcrBackend,
                                           "tesseract": TesseractBackend, "mmocr": MmocrBackend}


# A crop holds at most one character per MIN_CHAR_RATIO of its height: measured on COCO, grocery
# and the scene-text photos, no line of min_chars letters or digits read at the rule's confidence
# came from a narrower crop than 0.22 x height per character.
MIN_CHAR_RATIO = 0.2
# The cascade's gate passes a region of the detector's map at least GATE_CHAR_RATIO x min_chars
# as long as wide (the map shrinks each text box by the same margin on every side, so a line
# is more elongated there than its crop): measured on COCO, Flickr and the scene-text photos, a
# region that gave a flagged row was at least 3.2 times as long as wide (2.0 at min_chars 5).
GATE_CHAR_RATIO = 0.4


def fast_path(cfg: Any) -> Optional[FastPath | Cascade]:
    """``textspot.mode``'s settings (None: the full OCR); ``keep_texts`` recognises every box as
    the full OCR does, so that ocr_texts lists every line read (no gate; the cascade is then the
    full OCR)."""
    if cfg.mode == "full" or (cfg.mode == "cascade" and cfg.keep_texts):
        return None
    if cfg.mode == "cascade":
        return Cascade(gate_ratio=GATE_CHAR_RATIO * cfg.min_chars,
                       min_ratio=MIN_CHAR_RATIO * cfg.min_chars,
                       gate=cfg.gate, gate_min_pixels=cfg.gate_min_pixels,
                       stop_chars=cfg.min_chars if cfg.stop_early else 0,
                       stop_conf=cfg.min_conf, stop_within=cfg.max_texts)
    if cfg.keep_texts:
        return FastPath(det_pixels=cfg.det_pixels)
    return FastPath(det_pixels=cfg.det_pixels, min_ratio=MIN_CHAR_RATIO * cfg.min_chars, tight=True,
                    gate_pixels=cfg.gate_pixels)


def make_backend(cfg: Any) -> Any:
    """The backend ``cfg.backend`` names (``cfg``: the ``textspot`` config section)."""
    if cfg.backend == "rapidocr":
        return RapidOcrBackend(threads=cfg.threads, fast=fast_path(cfg), device=cfg.device,
                               runtime=cfg.runtime, precision=cfg.precision)
    if cfg.backend == "tesseract":
        return TesseractBackend(lang=cfg.tesseract_lang, psm=cfg.tesseract_psm, threads=cfg.threads)
    if cfg.backend == "mmocr":
        return MmocrBackend(det=cfg.mmocr_det, rec=cfg.mmocr_rec, det_weights=cfg.mmocr_det_weights,
                            rec_weights=cfg.mmocr_rec_weights)
    raise BackendUnavailable(f"textspot.backend={cfg.backend!r}: unknown "
                             f"(known: {sorted(BACKENDS)})")


def spot_all(backend: Callable, images: Sequence[bytes], max_side: int,
             captions: Optional[Sequence[Sequence[str]]] = None
             ) -> tuple[list[Optional[list[Spot]]], list[Optional[str]]]:
    """OCR a batch of encoded images: (spots per image, error note per image). The batch goes to the
    backend at once; if that fails, image by image, and an image that still fails gets ``None``
    spots and a note (one bad image never stops a part). ``captions`` (per image, optional) go
    to a backend that ``reads_captions``."""
    def call(ims: list, caps: Optional[Sequence]) -> list:
        if caps is not None and getattr(backend, "reads_captions", False):
            return list(backend([load_image(b, max_side) for b in ims], caps))
        return list(backend([load_image(b, max_side) for b in ims]))
    try:
        return call(list(images), captions), [None] * len(images)
    except Exception:  # noqa: BLE001 - retried image by image below
        pass
    spots: list[Optional[list[Spot]]] = []
    errors: list[Optional[str]] = []
    for i, b in enumerate(images):
        try:
            spots.append(call([b], None if captions is None else [captions[i]])[0])
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - recorded in the row
            spots.append(None)
            errors.append(f"text spotting failed on this image: {type(e).__name__}: {e}"[:300])
    return spots, errors


def backend_identity(cfg: Any) -> str:
    """The configured backend's name and version as installed, or ``... missing``, without loading
    models (cheap: for a run fingerprint, so that installing the backend later reruns a stage that
    skipped text spotting)."""
    from importlib import metadata
    dist = {"rapidocr": "rapidocr-onnxruntime", "tesseract": "pytesseract", "mmocr": "mmocr"}
    try:
        out = f"{cfg.backend} {metadata.version(dist.get(cfg.backend, cfg.backend))}"
    except metadata.PackageNotFoundError:
        return f"{cfg.backend} missing"
    if cfg.backend == "tesseract":
        import pytesseract
        try:
            out += f" (tesseract {pytesseract.get_tesseract_version()})"
        except Exception:  # noqa: BLE001 - binary absent
            return f"{cfg.backend} missing (no tesseract binary)"
    return out
