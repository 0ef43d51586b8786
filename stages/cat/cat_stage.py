"""DiHT's CAT filter, its first stage: ``cat`` parses each caption (complexity and actions).

CAT runs as two stages, with ``textspot`` (``textspot_stage.py``) after ``cat`` in the DAG, so
that OCR (about 0.3 s an image on a core, against 0.5 ms a caption for the parse) only sees the
rows the parse kept: the runner hands a stage only the rows still kept. They also get their own
resources (OCR wants bigger actors, later GPUs), their own fingerprints (changing an OCR
threshold does not re-parse) and their own reason counts. To OCR every row, set
``run.compute_on_flagged: true`` or declare textspot after ("ingest", "ids") only, beside cat.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.foundation.params import Params, at_least, doc, positive
from vlcurate.schemas import F, conform
from vlcurate.schemas import cat as S
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import Finding, MapStage, Resources, opened

from . import parser as P
from .optional import decide, skip_status, skipped_table


@dataclass(frozen=True)
class CatParams(Params):
    """DiHT's CAT parse (stage ``cat``): complexity and actions of each caption (spaCy)."""
    spacy_model: str = doc("auto", (
        "a spaCy package name or pipeline directory (UD or ClearNLP labels); auto: the first "
        "installed English pipeline, en_core_web_* first"))
    if_missing: Literal["error", "skip"] = doc("error", "no spaCy pipeline: stop (error), or "
                                                        "run without the parse, saying so")
    n_process: int = positive(1, doc="nlp.pipe processes inside one stage instance")
    pipe_batch_size: int = positive(512, doc="nlp.pipe batch size")
    gemm: Literal["numpy", "blis"] = doc("numpy", "thinc's dense layers: numpy's BLAS (faster) "
                                                  "or BLIS")
    min_complexity: int = at_least(1, -1, doc=(
        "keep captions of complexity >= this (-1: no object; DiHT's C0, C1, ...)"))
    require_action: bool = doc(True, "keep only captions with an action (DiHT's best filter)")
    participle_actions: bool = doc(True, "DiHT: \"running person\" is an attribute and an "
                                         "action")
    verb_nouns: bool = doc(True, (
        "read as a verb a noun the parse shows to be one (its subject disagreeing in number: \"a "
        "dog leaps\"), the tagger's mistake"))
    title_case: Literal["keep", "lower"] = doc("keep", (
        "lower: parse a Title Case caption in lower case (the tagger reads capitalised words as "
        "proper nouns, never objects); keep: as written (DiHT)"))
    resources: Resources = Resources()


class CatStage(MapStage):
    """Complexity and actions (``cat.low_complexity``, ``cat.no_action``)."""
    name = "cat"
    version = "2"
    Params = CatParams
    speed_only = ("n_process", "pipe_batch_size", "gemm")  # processes, batches, BLAS kernels
    inputs = {"ingest": (F.CAPTION,)}
    output = S.CAT
    resources = Resources(num_cpus=1, batch_size=0)
    on_actors = True
    # DiHT Table 1: complexity + actions keep 642M of LAION-2B's 1.98B (68% flagged on web
    # alt text); human captions lose far less (Flickr ~11%, COCO ~20%). Above 75% the captions
    # are most likely not the kind CAT was made for (product names, tags)
    expected_reject = 0.75
    knobs = {R.CAT_NO_ACTION: "cat.require_action=false (DiHT keeps captions with an action), "
                              "cat.participle_actions, cat.verb_nouns (verbs the tagger read as "
                              "nouns), or cat.title_case=lower for Title Case captions "
                              "(product names)",
             R.CAT_LOW_COMPLEXITY: "cat.min_complexity (-1 keeps captions with no object), or "
                                   "cat.title_case=lower for Title Case captions (product names), "
                                   "whose capitalised words parse as proper nouns, never objects"}

    @classmethod
    def preflight(cls, config: Any, stages: frozenset[str]) -> list[Finding]:
        c = config.cat
        return [opened("cat.spacy_model", c.if_missing,
                       lambda: P.load_pipeline(c.spacy_model, c.gemm).label, (P.PipelineMissing,))]

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
        self.pipe, self.skipped = decide(lambda: P.load_pipeline(c.spacy_model, c.gemm),
                                          c.if_missing, "parse")

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column(F.SAMPLE_ID.name)
        if self.pipe is None:
            return skipped_table(ids, S.CAT_SKIPPED, self.skipped, S.CAT)
        c = self.config.cat
        graphs = P.parse_texts(self.pipe, batch.column(F.CAPTION.name).to_pylist(), c.n_process,
                               c.pipe_batch_size, c.participle_actions,
                               c.title_case, c.verb_nouns)
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
        return skip_status(ctx, CatStage.name, S.CAT_SKIPPED.name,
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
