"""Export: join every stage's annotations, apply the keep policy, write WebDataset shards.

Filters only annotate; this is the one place rows are dropped, so changing the policy
(``export.drop``) re-runs this stage alone (``vlcurate export RUN_DIR --set export.drop=[...]``).

Shards follow open_clip's conventions: ``{key}.jpg`` (RGB JPEG), ``{key}.txt`` (the caption),
``{key}.json`` (the annotations), keyed by ``sample_id`` (no dots, stable); plus ``sizes.json``
(open_clip reads it for the sample count) and ``manifest.json`` (one entry per shard). Shards are
written deterministically (sorted members, zero mtimes), so the same run gives the same bytes.

Export reads only what it writes: embeddings (fixed-size vectors) and bytes are no
annotations, so they are never read back; they stay in their own stage's table (``embed/data``),
row-aligned and keyed by ``sample_id`` like every other table.
"""
from __future__ import annotations

import fnmatch
import functools
import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Optional, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.schemas import F, conform, tables
from vlcurate.schemas import concepts as CO
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as MI
from vlcurate.schemas import reasons as R
from vlcurate.schemas import recaption as RC
from vlcurate.foundation import storage
from vlcurate.foundation.params import Params, doc, positive
from vlcurate.stages import score_cut as cut
from vlcurate.stages.base import Resources, SinkStage
from vlcurate.foundation.layout import samples

EMBEDDINGS = (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME, E.CROSS_IMAGE_EMB_NAME, E.CROSS_TEXT_EMB_NAME)
_NEVER_ANNOTATED = {F.SAMPLE_ID.name, F.REASONS.name, F.REASON_DETAIL.name, F.IMAGE.name}


def is_annotation(field: pa.Field) -> bool:
    """False for embeddings (fixed-size lists) and raw bytes: export never reads or writes them."""
    return not (pa.types.is_fixed_size_list(field.type) or pa.types.is_binary(field.type)
                or pa.types.is_large_binary(field.type))


def drop_reasons(all_reasons: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """The reasons that drop a row: every ``ingest.*`` reason, and those matching a pattern."""
    pats = tuple(patterns)
    out: list[str] = []
    for r in all_reasons:
        if (r.startswith(R.MANDATORY_PREFIX) or any(fnmatch.fnmatchcase(r, p) for p in pats)) \
                and r not in out:
            out.append(r)
    return out


@dataclass(frozen=True)
class ExportParams(Params):
    """The keep policy and the outputs (stage ``export``): annotated Parquet and shards."""
    drop: tuple[str, ...] = doc(("*",), (
        "fnmatch patterns of reason codes that drop a row; ingest.* always drops"))
    samples_per_shard: int = positive(10_000, doc="rows per shard (the image layout counts rows "
                                                  "too)")
    shard_prefix: str = doc("shard", "shard file names: <prefix>-000000.tar")
    exclude_columns: tuple[str, ...] = doc((), "columns left out of the annotated table and "
                                               "the shards' json")
    layout: Literal["image", "pair"] = doc("pair", (
        "pair: one sample per kept row (open_clip sees every caption); image: one sample per "
        "image, its bytes once, every kept caption in its json (foundation/layout.py)"))
    embeddings: tuple[str, ...] = doc((), (
        "embed's vectors added to each sample as {key}.{name}.npy members (the image layout: "
        "the captions' vectors stacked), e.g. [image_emb, cross_image_emb]"))
    min_score: Optional[float] = doc(None, (
        "drop pairs whose cross_score (embed.cross_model's cosine) is below this, or missing "
        "(DataComp's CLIP-score threshold); null: no cut"))
    keep_top_fraction: Optional[float] = doc(None, (
        "keep the top share of the pool by cross_score, exact over the whole run (DataComp's "
        "0.3); the pool: rows the rest of the policy keeps (stages/score_cut.py); null: no cut"))
    top_fraction_per: Literal["run", "image_group"] = doc("run", (
        "keep_top_fraction over the whole pool (run), or of each image's pooled captions "
        "(image_group: every image keeps at least one)"))
    out_dir: Optional[str] = doc(None, "a folder or URI; null: <run_dir>/export")
    resources: Resources = Resources()
    fingerprint_when_set = ("min_score", "keep_top_fraction", "top_fraction_per")

    def check(self) -> Iterable[tuple[str, str]]:
        f = self.keep_top_fraction
        if f is not None and not 0 < f <= 1:
            yield ("keep_top_fraction", f"must be in (0, 1], got {f}")
        bad = sorted(set(self.embeddings) - set(EMBEDDINGS))
        if bad:
            yield ("embeddings", f"unknown embedding(s) {bad}; embed writes {list(EMBEDDINGS)}")


class ExportStage(SinkStage):
    name = "export"
    version = "4"   # the shard manifest counts rows (the image layout: captions) and samples
    Params = ExportParams
    resources = Resources(num_cpus=0.5, batch_size=0)

    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], config: Any) -> list[str]:
        skip = _NEVER_ANNOTATED | set(config.export.exclude_columns)
        return [f.name for f in (schema or []) if f.name not in skip and is_annotation(f)]

    @classmethod
    def output_schema(cls, upstream: Mapping[str, pa.Schema], config: Any) -> pa.Schema:
        cols: list[pa.Field] = []
        ex = config.export
        cut = "min_score" if ex.min_score is not None else "keep_top_fraction" \
            if ex.keep_top_fraction is not None else None
        if cut and upstream and not any(E.CROSS_SCORE.name in s.names for s in upstream.values()):
            from vlcurate.foundation.params import ConfigError
            raise ConfigError(f"export.{cut} cuts on cross_score, which embed writes only "
                              "with embed.cross_model set")
        for name, schema in upstream.items():
            keep = set(cls.input_columns(name, schema, config))
            cols += [f for f in schema if f.name in keep]
        return tables.stage_table(*tables.merge([pa.schema(cols)]).remove(0),
                                  *tables.EXPORT_DECISION)

    @classmethod
    def has_prepare(cls, cfg: Any) -> bool:
        return cfg.export.keep_top_fraction is not None

    @classmethod
    def prepare(cls, cfg: Any, read: Callable, n_parts: int, workdir: str) -> Any:
        """keep_top_fraction's exact cut over every part (stages/score_cut.py)."""
        ex = cfg.export
        read = read.narrowed([E.CROSS_SCORE.name, F.IMAGE_GROUP.name])   # and every reason
        return cut.plan_cut(read, n_parts, ex.keep_top_fraction, ex.top_fraction_per != "run",
                            functools.partial(kept_by_policy, drop=tuple(ex.drop),
                                              min_score=ex.min_score))

    def __call__(self, batch: pa.Table) -> pa.Table:
        schema: pa.Schema = self.schema
        ex = self.config.export
        every = cut.with_min_score(batch, batch.column(F.ALL_REASONS.name).to_pylist(),
                                   ex.min_score)
        every = cut.with_top_fraction(batch, every, self.state, ex.top_fraction_per != "run")
        batch = batch.set_column(batch.schema.get_field_index(F.ALL_REASONS.name),
                                 F.ALL_REASONS.name, pa.array(every, F.ALL_REASONS.type))
        drops = [policy_drops(rs, ex.drop) for rs in every]
        t = batch.append_column(F.KEEP.name, pa.array([not d for d in drops], pa.bool_()))
        t = t.append_column(F.REASONS.name, pa.array(drops, F.REASONS.type))
        t = t.append_column(F.REASON_DETAIL.name, pa.array(
            [f"export policy drops {', '.join(d)}" if d else None for d in drops], pa.string()))
        return conform(t, schema, extra="drop")

    @classmethod
    def finalize(cls, config: Any, ctx: "FinalizeContext") -> dict:
        kept = [c[F.MK.ROWS_KEPT] for c in ctx.counts]
        specs = plan_shards(kept, config.export.samples_per_shard, config.export.shard_prefix)
        final = storage.join(ctx.root, "shards")
        if storage.is_local(final):    # written aside, then the folder swapped in whole
            out = storage.join(ctx.tmp_dir, "shards")
            storage.makedirs(out)
        else:                          # no rename on an object store: see publish_in_place
            out = final
            storage.delete(storage.join(final, "manifest.json"))
        rows = ctx.map(functools.partial(write_shard, read=ctx.read, out_dir=out,
                                         layout=config.export.layout,
                                         embeddings=tuple(config.export.embeddings)), specs)
        publish = publish_shards if storage.is_local(final) else publish_in_place
        return publish(out, final, rows, policy(config.export, ctx.state), config.export.layout,
                       tuple(config.export.embeddings))


def policy_drops(reasons: list[str], drop: Iterable[str]) -> list[str]:
    """The reasons that drop a row under the policy: ``drop_reasons``, and the score cut (the
    policy itself, whatever ``export.drop`` says)."""
    return drop_reasons(reasons, drop) + [r for r in reasons if r == cut.LOW_SCORE]


def policy(ex: ExportParams, cuts: Optional[cut.Cuts]) -> dict:
    """The keep policy as the shard manifest records it, with where keep_top_fraction cut: the
    score of the last row kept (a run-wide share), or how many image groups lost captions."""
    out: dict = {"drop": list(ex.drop)}
    if ex.min_score is not None:
        out["min_score"] = ex.min_score
    if ex.keep_top_fraction is not None:
        out |= {"keep_top_fraction": ex.keep_top_fraction, "per": ex.top_fraction_per}
        if ex.top_fraction_per == "run":
            out["cut_score"] = (cuts or {}).get(None, (None,))[0]
        else:
            out["image_groups_cut"] = len(cuts or {})
    return out


def kept_by_policy(table: pa.Table, drop: tuple[str, ...], min_score: Optional[float]
                   ) -> list[bool]:
    """Which rows the policy keeps before keep_top_fraction: keep_top_fraction's pool."""
    every = cut.with_min_score(table, table.column(F.ALL_REASONS.name).to_pylist(), min_score)
    return [not policy_drops(rs, drop) for rs in every]


# --- shards ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSpec:
    name: str
    slices: tuple[tuple[int, int, int], ...]   # (part, first kept row, end kept row) in kept order


def plan_shards(kept_per_part: list[int], per_shard: int, prefix: str = "shard") -> list[ShardSpec]:
    """Cut the kept rows, in part order, into shards of ``per_shard`` (the last may be short)."""
    specs, cur, filled = [], [], 0
    for part, n in enumerate(kept_per_part):
        start = 0
        while start < n:
            take = min(n - start, per_shard - filled)
            cur.append((part, start, start + take))
            start += take
            filled += take
            if filled == per_shard:
                specs.append(cur)
                cur, filled = [], 0
    if cur:
        specs.append(cur)
    return [ShardSpec(f"{prefix}-{i:06d}.tar", tuple(s)) for i, s in enumerate(specs)]


def in_json(field: pa.Field) -> bool:
    """A column the ``{key}.json`` holds: an annotation, but no vector in disguise (a list of
    float vectors: the recaptions' embeddings) and no mining candidates (``hpm_pair_*``: the
    positives stage's inputs, kilobytes a row, which no trainer reads). They stay in the annotated
    Parquet table."""
    t = field.type
    nested = pa.types.is_list(t) and (pa.types.is_list(t.value_type)
                                      or pa.types.is_fixed_size_list(t.value_type))
    return is_annotation(field) and not nested and not field.name.startswith(JSON_OMITS)


JSON_OMITS = ("hpm_pair_",)       # name prefixes left out of the shard json


def annotation(row: dict, schema: pa.Schema) -> dict:
    """The ``{key}.json`` of a sample: every JSON-friendly annotation (no embeddings, no bytes)."""
    out = {}
    for f in schema:
        if f.name in (F.KEEP.name, F.REASONS.name, F.REASON_DETAIL.name) or not in_json(f):
            continue
        out[f.name] = row.get(f.name)
    if isinstance(out.get(F.EXTRA.name), str):
        try:
            out[F.EXTRA.name] = json.loads(out[F.EXTRA.name])
        except ValueError:
            pass
    return out


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> int:
    """Append a member; return the byte offset of its data in the tar (for random access)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uname = info.gname = ""
    start = tf.offset + len(info.tobuf(tf.format, tf.encoding, tf.errors))
    tf.addfile(info, io.BytesIO(data))
    return start


def _vectors(read: Callable, part: int, keep: pa.ChunkedArray, lo: int, hi: int,
             names: tuple[str, ...]) -> dict:
    """{name: [rows, d] array} of embed's vectors for the kept rows [lo, hi) of a part."""
    if not names:
        return {}
    import numpy as np
    t = read("embed", part, list(names)).filter(keep).slice(lo, hi - lo)
    out = {}
    for n in names:
        typ = t.schema.field(n).type
        dtype = np.float16 if typ.value_type == pa.float16() else np.float32
        out[n] = np.array([np.full(typ.list_size, np.nan) if v is None else v
                           for v in t.column(n).to_pylist()], dtype).reshape(-1, typ.list_size)
    return out   # a row embed did not compute: NaNs


def _npy(array) -> bytes:
    """One array as ``.npy`` bytes (numpy's own format: dtype and shape in its header)."""
    import numpy as np
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_shard(spec: ShardSpec, read: Callable[[str, int, Optional[list[str]]], pa.Table],
                out_dir: str, layout: str = "pair", embeddings: tuple[str, ...] = ()) -> dict:
    """Write one shard from the kept rows of the parts it covers, in ``layout``
    (``foundation/layout.py``); returns its manifest row."""
    out_uri = storage.join(out_dir, spec.name)
    fs, out_path = storage.resolve(out_uri)
    storage.ensure_parent(fs, out_path)
    n, first, last = 0, None, None     # samples; the rows they hold are the index's entries
    index: dict[str, list] = {f.name: [] for f in tables.SHARD_INDEX}
    missing = Missing()
    # streamed: a shard is never held whole in memory (an object store uploads it in parts and
    # shows it only once complete)
    with fs.open_output_stream(out_path) as fh, \
            tarfile.open(fileobj=fh, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for part, lo, hi in spec.slices:
            ann = read("export", part, None)
            keep = ann.column(F.KEEP.name)
            ann = ann.filter(keep).slice(lo, hi - lo)
            img = read("ingest", part, [F.SAMPLE_ID.name, F.IMAGE.name]).filter(keep).slice(lo, hi - lo)
            if not img.column(F.SAMPLE_ID.name).equals(ann.column(F.SAMPLE_ID.name)):
                raise RuntimeError(f"part {part}: export and ingest tables are not row-aligned")
            positions = {sid: i for i, sid in enumerate(ann.column(F.SAMPLE_ID.name).to_pylist())}
            missing.add(ann)
            rows = ann.to_pylist()
            metas = [annotation(r, ann.schema) for r in rows]
            vectors = _vectors(read, part, keep, lo, hi, embeddings)
            for key, members, entries in samples(layout, rows, img.column(F.IMAGE.name)
                                                 .to_pylist(), metas):
                at = {ext: _add(tf, f"{key}.{ext}", data) for ext, data in members.items()}
                for name, vec in vectors.items():
                    rows_of = [positions[sid] for sid, _, _ in entries]
                    _add(tf, f"{key}.{name}.npy", _npy(vec[rows_of[0]] if layout == "pair"
                                                       else vec[rows_of]))
                for sid, group, k in entries:
                    index[F.SAMPLE_ID.name].append(sid)
                    index[F.SH_NAME.name].append(spec.name)
                    index[F.IMAGE_GROUP.name].append(group)
                    index[F.SH_CAPTION.name].append(k)
                    for ext, data in members.items():
                        index[F.SH_RANGES[ext][0].name].append(at[ext])
                        index[F.SH_RANGES[ext][1].name].append(len(data))
                first = first or key
                last = key
                n += 1
    # where each sample's members sit: the trainer fetches a seed's hard pairs by random access
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table(index, schema=tables.SHARD_INDEX), buf)
    storage.write_bytes(storage.join(out_dir, "index", spec.name.replace(".tar", ".parquet")),
                        buf.getvalue().to_pybytes())
    return {F.SH_NAME.name: spec.name, F.SH_SAMPLES.name: n,
            F.SH_ROWS.name: len(index[F.SAMPLE_ID.name]), F.SH_BYTES.name: storage.size(out_uri),
            F.SH_FIRST.name: first, F.SH_LAST.name: last, MISSING: missing.counts}


MISSING = "missing"      # manifest.json: {annotation: {"rows": n, "why": {reasons: n}}}


class Missing:
    """The kept rows that lack an annotation (a null), per column, and why: the reasons the row
    carries (a heavy stage skips a row an earlier filter flagged, and the policy kept it), or
    none (the stage did not compute it: a per-image result of an image none of whose rows was
    still kept, or a stage that did not run on it)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict] = {}

    def add(self, ann: pa.Table) -> None:
        reasons = None
        for f in ann.schema:
            if f.name not in TRAINED_ON:
                continue
            nulls = ann.column(f.name).is_null().to_numpy(zero_copy_only=False)
            if not nulls.any():
                continue
            if reasons is None:
                reasons = ann.column(F.ALL_REASONS.name).to_pylist()
            c = self.counts.setdefault(f.name, {"rows": 0, "why": {}})
            c["rows"] += int(nulls.sum())
            for i in nulls.nonzero()[0]:
                why = ", ".join(sorted(set(reasons[i]))) or "no reason: not computed for it"
                c["why"][why] = c["why"].get(why, 0) + 1


# the annotations a loss of the trainer reads (trainer/fields.py): each kept row lacking one is
# counted in the manifest, and the trainer refuses them unless finetune.allow_missing
TRAINED_ON = frozenset(f.name for f in (
    MI.HARD_IDS, MI.POSITIVE_IDS, MI.POSITIVE_RELATIONS, RC.RECAPTIONS, CO.CONCEPT_OBJECT_IDS,
    CO.CONCEPT_OBJECT_PROBS, CO.CONCEPT_ATTRIBUTE_IDS, CO.CONCEPT_ATTRIBUTE_PROBS))


def _merge_missing(rows: list[dict]) -> dict:
    out: dict[str, dict] = {}
    for r in rows:
        for col, c in (r.pop(MISSING, None) or {}).items():
            o = out.setdefault(col, {"rows": 0, "why": {}})
            o["rows"] += c["rows"]
            for why, n in c["why"].items():
                o["why"][why] = o["why"].get(why, 0) + n
    return dict(sorted(out.items()))


def dataset_card(layout: str, embeddings: Iterable[str] = ()) -> str:
    """The shards' ``README.md``: a Hugging Face dataset card whose YAML names the shards and
    their features (``load_dataset(<shards folder>)`` reads it), so no type is guessed from the
    first samples (a null or an empty list there would fix a column to null)."""
    vec = "  list: float32" if layout == "pair" else "  list:\n      list: float32"
    jpg, txt, js = F.SHARD_MEMBERS
    feats = [(jpg, "  dtype: image"), (txt, "  dtype: string"), (js, "  dtype: json"),
             *((f"{e}.npy", vec) for e in embeddings),
             ("__key__", "  dtype: string"), ("__url__", "  dtype: string")]
    body = "".join(f"  - name: {n}\n  {t}\n" for n, t in feats)
    return ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
            f"    path: \"*.tar\"\ndataset_info:\n  features:\n{body}---\n\n"
            f"WebDataset shards written by vlcurate (layout: {layout}); see manifest.json.\n")


def _shard_files(folder: str, rows: list[dict], policy: dict, layout: str,
                 embeddings: Iterable[str] = ()) -> dict:
    """Write sizes.json and the dataset card, then manifest.json (last: it makes the shards
    visible); the summary."""
    missing = _merge_missing(rows)
    table = conform(pa.Table.from_pylist(rows, schema=tables.SHARDS), tables.SHARDS)
    summary = {"shards": len(rows), "samples": sum(r[F.SH_SAMPLES.name] for r in rows),
               F.SH_ROWS.name: sum(r[F.SH_ROWS.name] for r in rows),
               "bytes": sum(r[F.SH_BYTES.name] for r in rows), "policy": policy,
               "layout": layout,
               MISSING: missing}
    storage.write_bytes(storage.join(folder, "sizes.json"), json.dumps(
        {r[F.SH_NAME.name]: r[F.SH_SAMPLES.name] for r in rows}, indent=1).encode())
    storage.write_bytes(storage.join(folder, "README.md"),
                        dataset_card(layout, embeddings).encode())
    storage.write_bytes(storage.join(folder, "manifest.json"), json.dumps(
        {**summary, "files": table.to_pylist()}, indent=1).encode())
    return summary


def publish_in_place(folder: str, final: str, rows: list[dict], policy: dict,
                     layout: str = "pair", embeddings: tuple[str, ...] = ()) -> dict:
    """On an object store the shards were written under their final names (the old manifest
    removed first, so no reader pairs it with new shards); the manifest goes last, then the
    shards and index files of an earlier export that it does not list are deleted."""
    summary = _shard_files(final, rows, policy, layout, embeddings)
    keep = {r[F.SH_NAME.name] for r in rows} | {"sizes.json", "manifest.json", "README.md"}
    keep |= {n.replace(".tar", ".parquet") for n in keep if n.endswith(".tar")}
    for info in storage.list_files(final):
        if info.base_name not in keep:
            storage.delete(storage.join(final, info.path.rsplit("/shards/", 1)[-1]))
    return summary


def publish_shards(tmp: str, final: str, rows: list[dict], policy: dict,
                   layout: str = "pair", embeddings: tuple[str, ...] = ()) -> dict:
    """Write sizes.json, the dataset card and manifest.json beside the shards, then swap the
    folder in whole."""
    summary = _shard_files(tmp, rows, policy, layout, embeddings)
    tmp, final = Path(storage.local_path(tmp)), Path(storage.local_path(final))
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return summary


class FinalizeContext(Protocol):
    """What the runner hands to ``finalize`` (implemented in pipeline/runner.py)."""
    counts: list[dict]                         # per part: rows, rows_in, rows_rejected, ...
    read: Callable[[str, int, Optional[list[str]]], pa.Table]   # (stage, part, columns)
    map: Callable[[Callable, list], list]      # parallel map (Ray tasks or in-process)
    root: str                                  # the stage's folder (a path or a URI)
    tmp_dir: str                               # scratch under the stage's _tmp, every worker sees
    state: Any                                 # what the stage's prepare returned, or None
