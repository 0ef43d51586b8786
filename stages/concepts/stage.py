"""The concepts stage: DiHT's concept-distillation targets (paper sec. 3.2, appendix A.1.2).

The frozen teacher's features of every still-kept image come from the ``teacher`` stage
(``teacher_stage.py``: part by part, on an actor pool). Global step (``prepare``): the
vocabulary is built from the CAT parse of every kept row (``vocab.py``, counted part by part),
and linear heads for objects and attributes are trained on the features of a bounded sample of
those rows (``concepts.train_rows``, chosen by a seeded hash of ``sample_id``: the same rows
whatever the parts or their order; ``heads.py``), the attribute candidates first going through
the visualness filter. Its memory is bounded by the sample and the vocabulary, never the
dataset. Per part (``__call__``): each row's features -> softmax -> top-k (default 10),
renormalised -> concept ids (uint16) and probabilities (float16). ``finalize`` publishes the vocabulary table (and the heads) beside the
stage's table: ``<run>/concepts/vocab.parquet``.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.foundation.params import (ConfigError, FrozenMap, ModelSpec, Params, doc, positive,
                                        within)
from vlcurate.schemas import F, conform
from vlcurate.schemas import concepts as S
from vlcurate.foundation import models
from vlcurate.stages.arrow import list_array
from vlcurate.stages.base import Finding, GlobalStage, Resources

from . import heads as H
from . import vocab as V
from .wordnet import open_wordnet

log = logging.getLogger(__name__)
PUBLISHED = ("vocab.parquet", "heads_objects.npz", "heads_attributes.npz")


def _lists(a: np.ndarray, field: pa.Field) -> pa.Array:
    """(n, k) array -> a list column of n lists of k values (the field's value type)."""
    n, k = a.shape
    vt = field.type.value_type
    return list_array(np.full(n, k), pa.array(a.reshape(-1).astype(vt.to_pandas_dtype()), vt),
                      type=field.type)


EMPTY_NOTE = "empty_vocabulary.txt"


class EmptyVocabulary(ConfigError):
    """A concept vocabulary the thresholds left empty (``concepts.if_empty: error``): a config
    problem, so the command line prints it as one line."""


def _empty(problem: Optional[str], c: Any, workdir: str) -> Optional[str]:
    """Stop on an empty vocabulary (``if_empty: error``), or log it and keep it for the run
    summary (``warn``: the stage then writes empty targets of that kind)."""
    if problem is None:
        return None
    if c.if_empty == "error":
        raise EmptyVocabulary(f"{problem}; or set concepts.if_empty: warn to run on without them")
    note = f"{problem} (concepts.if_empty: warn, so its targets are empty)"
    log.warning(note)
    with open(os.path.join(workdir, EMPTY_NOTE), "w") as fh:
        fh.write(note)
    return note


@dataclass(frozen=True)
class ConceptsParams(Params):
    """DiHT concept-distillation targets (stage ``concepts``): WordNet vocabulary from the CAT
    parse, frozen teacher features, linear heads, top-k soft targets per image."""
    teacher: ModelSpec = doc(ModelSpec(id="torchvision/vit_h_14", options=FrozenMap(
        {"weights": "IMAGENET1K_SWAG_LINEAR_V1"})), (
        "the frozen teacher (DiHT: SWAG ViT-H/14): torchvision/<name> (with options.weights) or "
        "any timm backbone"))
    teacher_batch_size: int = positive(64, doc="images per teacher forward pass")
    # It bounds the global step's memory: rows x the teacher's width x 2 bytes (ViT-H/14:
    # 1.3 GB at 500k).
    train_rows: Optional[int] = positive(500_000, doc=(
        "the heads train on at most this many kept rows, those with the smallest seeded hash of "
        "their sample_id; null: every row (the vocabulary still counts every kept row)"))
    wordnet_dir: str = doc("/usr/share/wordnet", (
        "WordNet 3.0 dict files (Debian: wordnet-base); without them there, the copy shipped "
        "with vlcurate"))
    min_object_count: int = doc(250, "DiHT: noun synsets in at least this many images become "
                                     "objects (250 over LAION)")
    min_attribute_count: int = doc(250, "the same for attributes")
    if_empty: Literal["error", "warn"] = doc("error", (
        "a vocabulary the thresholds leave empty: stop, naming the key to lower (error), or go "
        "on with empty targets of that kind, said in the run summary (warn)"))
    max_objects: Optional[int] = positive(None, doc=(
        "keep only this many most frequent objects; null: up to 65535 (vocab.MAX_VOCAB: ids are "
        "uint16)"))
    hypernym_backoff: bool = doc(False, "a rare synset counts as its nearest kept hypernym")
    min_sharedness: int = doc(3, "distinct vocabulary objects an attribute must describe")
    min_visualness: Optional[float] = within(0.6, 0, 1, open_hi=True, doc=(
        "an attribute's teacher head must reach this held-out AUC; null: off"))
    max_attributes: Optional[int] = positive(1200, doc=(
        "attributes kept, by visualness then sharedness (DiHT: 1200); null: all"))
    holdout_fraction: float = within(0.1, 0, 1, open_hi=True, doc=(
        "share of images held out to measure visualness"))
    top_k: int = positive(10, doc="objects and attributes kept per image (DiHT: top-10)")
    epochs: int = positive(10, doc="the heads' training epochs")
    resample_length: Optional[int] = positive(None, doc=(
        "draws per epoch (DiHT: 50M); null: the number of training images"))
    batch_size: int = positive(256, doc="rows per head-training batch")
    base_lr: float = doc(0.001, "the heads' lr = base_lr x batch_size / 256 (linear scaling "
                                "rule)")
    momentum: float = doc(0.9, "SGD momentum of the heads")
    weight_decay: float = doc(1e-4, "the heads' weight decay")
    seed: int = doc(0, "seeds the training sample, the holdout and the heads")
    resources: Resources = Resources()

    def check(self) -> Iterable[tuple[str, str]]:
        if isinstance(self.max_objects, int) and self.max_objects > 65535:
            yield ("max_objects", f"ids are uint16, at most 65535, got {self.max_objects}")


def _sample_hash(ids: list[str], seed: int) -> np.ndarray:
    return np.array([int.from_bytes(hashlib.blake2b(f"{seed}\0{i}".encode(), digest_size=8)
                                    .digest(), "little") for i in ids], np.uint64)


def _take(d: dict, sel: np.ndarray) -> dict:
    return {k: v[sel] for k, v in d.items()}


def _part_sample(t: pa.Table, part: int, seed: int) -> dict:
    col = t.column(S.TEACHER_FEATURES_NAME).combine_chunks()
    n, d = t.num_rows, col.type.list_size
    obj, att = np.empty(n, object), np.empty(n, object)
    obj[:], att[:] = t.column(S.OBJECT_WORDS.name).to_pylist(), \
        t.column(S.ATTRIBUTE_WORDS.name).to_pylist()
    return {"key": _sample_hash(t.column(F.SAMPLE_ID.name).to_pylist(), seed),
            "pos": (np.int64(part) << 32) + t.column(F.ROW.name).to_numpy().astype(np.int64),
            "x": np.asarray(col.flatten()).reshape(n, d), "obj": obj, "att": att}


def training_sample(read: Callable[[int], pa.Table], n_parts: int, limit: Optional[int],
                    seed: int, tally: Optional[V.Tally] = None) -> dict:
    """The still-kept rows the heads train on, in part order: all of them, or the ``limit``
    with the smallest seeded hashes of their sample_id (ties: the earlier row). Holds at most
    ``limit`` rows plus one part. Every row's words go to ``tally`` (the vocabulary is
    counted over all of them, as DiHT counts over the whole dataset)."""
    keep: Optional[dict] = None
    for part in range(n_parts):
        t = read(part)
        if not t.num_rows:
            continue
        got = _part_sample(t, part, seed)
        if tally is not None:
            tally.add(list(got["obj"]), list(got["att"]))
        keep = got if keep is None else {k: np.concatenate([keep[k], got[k]]) for k in got}
        if limit is not None and len(keep["key"]) > limit:
            keep = _take(keep, np.lexsort((keep["pos"], keep["key"]))[:limit])
    if keep is None:
        return {"x": np.zeros((0, 0), np.float16), "obj": [], "att": []}
    return _take(keep, np.argsort(keep["pos"], kind="stable"))


class ConceptsStage(GlobalStage):
    name = "concepts"
    version = "3"                       # every caption of a kept image (per_image)
    per_image = True
    Params = ConceptsParams
    inputs = {"teacher": (S.TEACHER_FEATURES, S.CONCEPT_TEACHER, S.CONCEPT_RANDOM),
              "cat": (S.OBJECT_WORDS, S.ATTRIBUTE_WORDS)}
    output = S.CONCEPT_TARGETS
    wants_position = True               # the training sample's order is the rows' (part, row)
    resources = Resources(num_cpus=1, num_gpus=0, batch_size=0)

    @classmethod
    def preflight(cls, config: Any, stages: frozenset[str]) -> list[Finding]:
        from .wordnet import WordNetMissing
        try:
            wn = open_wordnet(config.concepts.wordnet_dir)
            return [Finding(True, f"concepts.wordnet_dir: {wn.label}")]
        except WordNetMissing as e:
            return [Finding(False, f"concepts.wordnet_dir: {e}")]

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        t = config.concepts.teacher
        return [(f"concepts: the teacher {t.id!r} has RANDOM weights (concepts.teacher."
                 "random_init): its concept targets are for testing only")] if t.random_init else []

    @classmethod
    def prepare(cls, config: Any, read: Callable[[int], pa.Table], n_parts: int, workdir: str) -> dict:
        c = config.concepts
        wn = open_wordnet(c.wordnet_dir)          # fails fast, before the sample is read
        tally = V.Tally(wn)
        sample = training_sample(read, n_parts, c.train_rows, c.seed, tally)
        x, objects, attributes = sample["x"], list(sample["obj"]), list(sample["att"])
        obj, att, obj_labels, att_labels = V.build(objects, attributes, wn, c, tally)
        _empty(V.emptiness(obj, att, tally.n_images, c), c, workdir)
        device = models.device_for(c.teacher)
        if c.min_visualness is not None and att.names and len(x):
            vis = H.visualness(x, V.to_ids(att_labels, att), len(att.names), c, device)
            att.visualness = {n: float(v) for n, v in zip(att.names, vis, strict=True)
                              if not np.isnan(v)}
            att = att.keep(H.select_attributes(att.names, vis, att.sharedness, c))
            _empty(V.emptiness(obj, att, tally.n_images, c, "visualness"), c, workdir)
        elif c.max_attributes:
            att = att.keep(att.names[:c.max_attributes])
        out = {"n_objects": len(obj.names), "n_attributes": len(att.names)}
        for kind, con, labels in (("objects", obj, obj_labels), ("attributes", att, att_labels)):
            head = H.train_head(x, V.to_ids(labels, con), len(con.names), c, device) \
                if len(x) else None
            out[kind] = os.path.join(workdir, f"heads_{kind}.npz") if head else None
            if head:
                head.save(out[kind])
        pq.write_table(pa.Table.from_pylist(obj.rows() + att.rows(), schema=S.CONCEPT_VOCAB),
                       os.path.join(workdir, "vocab.parquet"))
        return out

    @classmethod
    def finalize(cls, config: Any, ctx: Any) -> dict:
        src = Path(ctx.workdir)
        for name in PUBLISHED:
            if (src / name).exists():
                ctx.publish(str(src / name), name)
        empty = src / EMPTY_NOTE      # concepts.if_empty: warn; "skipped" reaches the summary
        return {"vocab": ctx.uri("vocab.parquet"),
                **({"skipped": [empty.read_text()]} if empty.exists() else {})}

    def setup(self) -> None:
        self.cfg, st = self.config.concepts, self.state or {}
        self.heads = {k: H.Head.load(st[k]) if st.get(k) else None
                      for k in ("objects", "attributes")}

    def __call__(self, batch: pa.Table) -> pa.Table:
        col = batch.column(S.TEACHER_FEATURES_NAME).combine_chunks()
        x = np.asarray(col.flatten()).reshape(batch.num_rows, col.type.list_size) \
            .astype(np.float32)
        cols = {F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name)}
        for kind, ids_f, probs_f in (("objects", S.CONCEPT_OBJECT_IDS, S.CONCEPT_OBJECT_PROBS),
                                     ("attributes", S.CONCEPT_ATTRIBUTE_IDS,
                                      S.CONCEPT_ATTRIBUTE_PROBS)):
            ids, probs = H.top_k(self.heads[kind], x, self.cfg.top_k)
            cols[ids_f.name], cols[probs_f.name] = _lists(ids, ids_f), _lists(probs, probs_f)
        cols[S.CONCEPT_TEACHER.name] = batch.column(S.CONCEPT_TEACHER.name)
        cols[S.CONCEPT_RANDOM.name] = batch.column(S.CONCEPT_RANDOM.name)
        cols[F.REASONS.name] = pa.array([[]] * batch.num_rows, F.REASONS.type)
        return conform(pa.table(cols), self.output)
