"""DiHT's CAT filter as two stages: ``cat`` (parse: complexity and actions) then ``textspot`` (OCR).

Two stages, with ``textspot`` after ``cat`` in the DAG, so that OCR (about 0.3 s an image on a core,
against 0.5 ms a caption for the parse) only sees the rows the parse kept: the runner hands a stage
only the rows still kept. They also get their own resources (OCR wants bigger actors, later GPUs),
their own fingerprints (changing an OCR threshold does not re-parse) and their own reason counts.
There is no "OCR only kept rows" config key: the runner, not a stage, decides which rows a stage
sees. To OCR every row, set ``run.compute_on_flagged: true`` or declare textspot after
("ingest", "ids") only, beside cat, in the DAG.

A part that cannot run (no spaCy pipeline; OCR backend not installed) is skipped only when the
config says ``if_missing: skip``: every row then says so in ``cat_skipped`` / ``textspot_skipped``,
and ``finalize`` returns and writes it (``<stage>/status.json``) for the run summary. The decision
is taken once per run in ``prepare`` so that every worker agrees.
"""
from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from vlcurate.schemas import F, conform
from vlcurate.schemas import cat as S
from vlcurate.schemas import reasons as R
from vlcurate.pipeline.params import Params, at_least, positive, unit
from vlcurate.stages.base import MapStage, Resources, once_per_image

from . import parser as P
from . import textspot as T


def _decide(load: Callable[[], Any], if_missing: str, part: str) -> tuple[Any, Optional[str]]:
    """(loaded thing, None) or, when it cannot load and the config allows it, (None, skip note)."""
    try:
        return load(), None
    except (P.PipelineMissing, T.BackendUnavailable) as e:
        if if_missing != "skip":
            raise
        return None, f"{part} skipped: {getattr(e, 'short', e)}"


def _skipped(ids: Any, column: pa.Field, note: str, schema: pa.Schema) -> pa.Table:
    """Every row: no annotations, no reasons, and the note saying what was skipped."""
    return conform(pa.table({F.SAMPLE_ID.name: ids, column.name: [note] * len(ids),
                             F.REASONS.name: pa.array([[]] * len(ids), F.REASONS.type)}), schema)


def skip_notes(part: int, read: Any, stage: str, column: str) -> set:
    return {n for n in read(stage, part, [column]).column(column).to_pylist() if n}


def _status(ctx: Any, stage: str, column: str, extra: Optional[dict] = None) -> dict:
    """Which parts were skipped in this run (read back from the table), written to status.json."""
    notes = ctx.map(functools.partial(skip_notes, read=ctx.read, stage=stage, column=column),
                    list(range(len(ctx.counts))))
    info = {"skipped": sorted(set().union(*notes)), **(extra or {})}
    ctx.write_bytes("status.json", json.dumps(info, indent=1).encode())
    return info


@dataclass(frozen=True)
class CatParams(Params):
    """DiHT's CAT parse (stage ``cat``): complexity and actions of each caption (spaCy)."""
    # package name, pipeline directory (UD or ClearNLP labels), or auto: the first installed
    # English pipeline (en_core_web_* first)
    spacy_model: str = "auto"
    if_missing: Literal["error", "skip"] = "error"   # skip: run without it, saying so in the output
    n_process: int = positive(1)          # nlp.pipe processes inside one stage instance
    pipe_batch_size: int = positive(512)  # nlp.pipe batch size
    gemm: Literal["numpy", "blis"] = "numpy"   # thinc dense layers: numpy's BLAS (faster) or BLIS
    min_complexity: int = at_least(1, -1)  # keep complexity >= this (-1: no object; C0, C1, ...)
    require_action: bool = True           # keep only captions with an action
    participle_actions: bool = True       # DiHT: "running person" is an attribute and an action
    # lower: parse a Title Case caption ("Bravo Apple Juice") in lower case, since the tagger reads
    # capitalised words as proper nouns, never objects; keep: as written (DiHT)
    title_case: Literal["keep", "lower"] = "keep"
    resources: Resources = Resources()


class CatStage(MapStage):
    """Complexity and actions (``cat.low_complexity``, ``cat.no_action``)."""
    name = "cat"
    version = "1"
    Params = CatParams
    speed_only = ("n_process", "pipe_batch_size", "gemm")  # processes, batches, BLAS kernels
    inputs = {"ingest": (F.CAPTION,)}
    output = S.CAT
    resources = Resources(num_cpus=1, batch_size=0)
    on_actors = True

    @classmethod
    def environment(cls, config: Any) -> dict:
        """What the output depends on beyond config (for the runner's fingerprint)."""
        return {"spacy_model": P.pipeline_identity(config.cat.spacy_model)}

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        """Which pipeline ``auto`` chose (the run summary; ``_info.json`` keeps it with the run)."""
        c = config.cat
        ident = P.pipeline_identity(c.spacy_model) if c.spacy_model == "auto" else "missing"
        return [] if ident == "missing" else [
            f"cat: cat.spacy_model=auto parses with {ident} (the first installed English spaCy "
            "pipeline; set cat.spacy_model to choose one)"]

    def setup(self) -> None:
        c = self.config.cat
        self.pipe, self.skipped = _decide(lambda: P.load_pipeline(c.spacy_model, c.gemm),
                                          c.if_missing, "parse")

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column(F.SAMPLE_ID.name)
        if self.pipe is None:
            return _skipped(ids, S.CAT_SKIPPED, self.skipped, S.CAT)
        c = self.config.cat
        graphs = P.parse_texts(self.pipe, batch.column(F.CAPTION.name).to_pylist(), c.n_process,
                               c.pipe_batch_size, c.participle_actions,
                               c.title_case)
        reasons, details = [], []
        for g in graphs:
            rs, why = [], []
            if g.complexity < c.min_complexity:
                rs.append(R.CAT_LOW_COMPLEXITY)
                why.append(f"complexity {g.complexity} < {c.min_complexity}"
                           + (" (no object)" if g.complexity < 0 else ""))
            if c.require_action and not g.actions:
                rs.append(R.CAT_NO_ACTION)
                why.append("no action")
            reasons.append(rs)
            details.append("; ".join(why) or None)
        return conform(pa.table({
            F.SAMPLE_ID.name: ids,
            S.CAT_OBJECTS.name: [g.objects for g in graphs],
            S.CAT_ATTRIBUTES.name: [g.attributes for g in graphs],
            S.CAT_ACTIONS.name: [g.actions for g in graphs],
            S.CAT_RELATIONS.name: pa.array([[dict(zip(("head", "rel", "tail"), r))
                                             for r in g.relations] for g in graphs],
                                           S.CAT_RELATIONS.type),
            S.CAT_COMPLEXITY.name: pa.array([g.complexity for g in graphs], pa.int16()),
            S.CAT_N_ACTIONS.name: pa.array([g.n_actions for g in graphs], pa.int16()),
            S.CAT_MODEL.name: [self.pipe.label] * len(graphs),
            F.REASONS.name: pa.array(reasons, F.REASONS.type),
            F.REASON_DETAIL.name: pa.array(details, pa.string())}), S.CAT)

    @classmethod
    def finalize(cls, config: Any, ctx: Any) -> dict:
        """The per-run concept vocabulary: ``<stage>/concepts.parquet`` (schemas.cat.CONCEPTS)."""
        parts = ctx.map(functools.partial(count_concepts, read=ctx.read, stage=CatStage.name),
                        list(range(len(ctx.counts))))
        total: Counter = Counter()
        kept: Counter = Counter()
        for t, k in parts:
            total.update(t)
            kept.update(k)
        rows = sorted(total.items(), key=lambda kv: (kv[0][0] != "object", -kv[1], kv[0][1]))
        table = pa.table({S.CONCEPT_KIND.name: [k for (k, _), _ in rows],
                          S.CONCEPT.name: [c for (_, c), _ in rows],
                          S.CONCEPT_CAPTIONS.name: pa.array([n for _, n in rows], pa.int64()),
                          S.CONCEPT_KEPT.name: pa.array([kept[key] for key, _ in rows],
                                                        pa.int64())},
                         schema=S.CONCEPTS)
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        path = ctx.write_bytes("concepts.parquet", buf.getvalue().to_pybytes())
        n_kind = Counter(k for (k, _), _ in rows)
        return _status(ctx, CatStage.name, S.CAT_SKIPPED.name,
                       {"concepts": str(path), "objects": n_kind["object"],
                        "attributes": n_kind["attribute"], **CatStage.environment(config)})


def count_concepts(part: int, read: Any, stage: str) -> tuple[Counter, Counter]:
    """Captions mentioning each (kind, concept) in one part: all parsed rows, and those kept."""
    t = read(stage, part, [S.CAT_OBJECTS.name, S.CAT_ATTRIBUTES.name, F.REASONS.name])
    total: Counter = Counter()
    kept: Counter = Counter()
    for objs, attrs, rs in zip(*(t.column(c).to_pylist() for c in t.column_names)):
        if objs is None:              # not parsed: flagged upstream, or the parse was skipped
            continue
        keys = {("object", o) for o in objs} | {("attribute", a) for a in attrs or ()}
        total.update(keys)
        if not rs:
            kept.update(keys)
    return total, kept


@dataclass(frozen=True)
class TextSpotParams(Params):
    """DiHT's text spotting (stage ``textspot``): OCR, flag text that repeats the caption."""
    backend: Literal["rapidocr", "tesseract", "mmocr"] = "rapidocr"
    if_missing: Literal["error", "skip"] = "error"   # skip: run without it, saying so in the output
    min_conf: float = unit(0.8)           # DiHT: spotting confidence >= 0.8 ...
    min_chars: int = positive(5)          # ... and >= 5 characters matching the caption
    max_side: int = positive(1024)        # images are downscaled to this longer side before OCR
    max_texts: int = positive(32)         # spotted lines kept per image (best confidence first)
    threads: int = at_least(1, 0)         # OCR threads per stage instance (0: the backend's own)
    tesseract_lang: str = "eng"
    tesseract_psm: int = 11               # page segmentation mode 11: sparse text (scene text)
    mmocr_det: str = "DBNet"
    mmocr_rec: str = "SAR"
    mmocr_det_weights: Optional[str] = None
    mmocr_rec_weights: Optional[str] = None
    resources: Resources = Resources()


class TextSpotStage(MapStage):
    """OCR text that repeats the caption (``cat.text_spotted``)."""
    name = "textspot"
    version = "1"
    Params = TextSpotParams
    speed_only = ("threads",)             # OCR threads
    inputs = {"ingest": (F.CAPTION, F.IMAGE)}
    output = S.TEXTSPOT
    resources = Resources(num_cpus=1, batch_size=64)
    on_actors = True

    @classmethod
    def environment(cls, config: Any) -> dict:
        """What the output depends on beyond config (for the runner's fingerprint)."""
        return {"ocr_backend": T.backend_identity(config.textspot)}

    def setup(self) -> None:
        c = self.config.textspot
        self.ocr, self.skipped = _decide(lambda: T.make_backend(c), c.if_missing,
                                         f"text spotting ({c.backend})")

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column(F.SAMPLE_ID.name)
        if self.ocr is None:
            return _skipped(ids, S.TEXTSPOT_SKIPPED, self.skipped, S.TEXTSPOT)
        c = self.config.textspot
        # each distinct image is read once (COCO, Flickr: five captions per image); the match is
        # per caption
        pairs = once_per_image(batch.column(F.IMAGE.name).to_pylist(),
                               lambda ims: list(zip(*T.spot_all(self.ocr, ims, c.max_side))))
        spots, errors = [p[0] for p in pairs], [p[1] for p in pairs]
        spots = [None if s is None else sorted(s, key=lambda x: -x.conf)[:c.max_texts]
                 for s in spots]
        ms = [T.best_match(s or [], cap or "", c.min_conf)
              for s, cap in zip(spots, batch.column(F.CAPTION.name).to_pylist())]
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

    @classmethod
    def finalize(cls, config: Any, ctx: Any) -> dict:
        return _status(ctx, TextSpotStage.name, S.TEXTSPOT_SKIPPED.name)
