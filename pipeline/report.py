"""``vlcurate report RUN_DIR``: one static, self-contained HTML page about a run.

The page holds the per-stage funnel (kept, rejected by reason, from the manifests), histograms of
the annotations (caption complexity, OCR confidence, hard-pair scores and support, recaption
scores), image grids of the hard pairs and positives of random targets, examples rejected for
each reason, recaptions beside the original captions, and concept targets. Every section whose
columns exist in the run is rendered; the others are listed as absent, with the column that is
missing. Thumbnails are small base64 JPEGs, histograms inline SVG; no script, no network.

It stays fast on large runs because it never reads a whole table: statistics and samples come
from a seeded random subset of parts (``stats_rows`` rows at most), only the columns each section
needs are read, and images are fetched for the shown rows only: through the shard index (a seek
into the tar) for exported rows, else from the ingest part that holds them.
"""
from __future__ import annotations

import base64
import datetime as dt
import html
import io
import math
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from vlcurate.schemas import F
from vlcurate.schemas import cat as CS
from vlcurate.schemas import concepts as CO
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import recaption as RC

from vlcurate.foundation import storage
from .inspect import display, is_run_dir, run_config, stage_dir, stage_names
from .rundir import StageDir, read_json

PART_COL = "_report_part"


# --- reading the run ---------------------------------------------------------------------------
class RunData:
    """The run's stage folders, their schemas and manifests, and a seeded sample of parts."""

    def __init__(self, run_dir: str, stats_rows: int, seed: int) -> None:
        if not is_run_dir(run_dir):
            raise ReportError(f"{display(run_dir)} is not a vlcurate run directory (no run.json)")
        self.run_dir = run_dir
        self.config = run_config(run_dir)
        self.names = stage_names(run_dir)
        self.dirs: dict[str, StageDir] = {n: stage_dir(run_dir, n, self.config) for n in self.names}
        self.manifests = {n: d.manifest() for n, d in self.dirs.items()}
        self.schemas = {n: d.schema() for n, d in self.dirs.items()}
        self.rng = np.random.default_rng(seed)
        ingest = self.dirs.get("ingest")
        self.parts = ingest.committed() if ingest else []
        m = self.manifests.get("ingest") or {}
        self.total_rows = int(m.get(F.MK.ROWS) or 0)
        per_part = self.total_rows / max(len(self.parts), 1) or 1.0
        want = max(1, math.ceil(stats_rows / per_part))
        chosen = self.parts if want >= len(self.parts) else \
            sorted(self.rng.choice(self.parts, size=want, replace=False).tolist())
        self.stat_parts: list[int] = [int(p) for p in chosen]
        self.stat_rows = int(round(per_part * len(self.stat_parts))) if self.total_rows else 0
        self._cache: dict[tuple, Optional[pa.Table]] = {}
        export = self.dirs.get("export")
        shards = read_json(export.uri("shards", "manifest.json")) if export else None
        self.policy: dict = (shards or {}).get("policy", {})

    def where(self, f: pa.Field) -> Optional[str]:
        """The stage whose table has column ``f`` (a stage's own table before export's copy)."""
        found = [n for n, s in self.schemas.items() if s is not None and f.name in s.names]
        own = [n for n in found if n != "export"]
        return (own or found or [None])[0]

    def sample(self, *fields: pa.Field) -> Optional[pa.Table]:
        """``sample_id``, the fields and the part of every row in the sampled parts (one stage)."""
        stage = self.where(fields[0])
        if stage is None:
            return None
        key = (stage, tuple(f.name for f in fields))
        if key not in self._cache:
            sd = self.dirs[stage]
            cols = [F.SAMPLE_ID.name] + [f.name for f in fields
                                         if f.name in self.schemas[stage].names]
            committed = set(sd.committed())
            parts = [p for p in self.stat_parts if p in committed]

            missing = [f for f in fields if f.name not in self.schemas[stage].names]

            def read(p: int) -> pa.Table:   # a column the stage does not write reads as nulls
                t = sd.read(p, cols)
                for f in missing:
                    t = t.append_column(f.name, pa.nulls(t.num_rows, f.type))
                return t.append_column(PART_COL, pa.array(np.full(t.num_rows, p, np.int32)))
            with ThreadPoolExecutor(4) as pool:
                tables = list(pool.map(read, parts))
            self._cache[key] = pa.concat_tables(tables) if tables else None
        return self._cache[key]

    def values(self, f: pa.Field) -> Optional[np.ndarray]:
        """The non-null values of a column in the sampled parts, list columns flattened."""
        t = self.sample(f)
        if t is None:
            return None
        col = t.column(f.name)
        if pa.types.is_list(col.type):
            col = pc.list_flatten(col)
        return col.drop_null().to_numpy(zero_copy_only=False).astype(np.float64)


class ReportError(RuntimeError):
    pass


# --- images ------------------------------------------------------------------------------------
@dataclass
class Item:
    caption: Optional[str] = None
    image_ref: Optional[str] = None
    uri: Optional[str] = None       # data: URI of the thumbnail
    note: str = ""                  # why there is no thumbnail


def thumbnail(data: Optional[bytes], size: int) -> Optional[str]:
    if not data:
        return None
    from PIL import Image
    try:
        im = Image.open(io.BytesIO(data))
        im.draft("RGB", (size * 2, size * 2))   # JPEG: decode at a reduced scale
        im = im.convert("RGB")
        im.thumbnail((size, size))
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=70, optimize=True)
    except Exception:  # noqa: BLE001 - a broken image is shown as such, never fatal
        return None
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


class Images:
    """Captions and thumbnails of given sample ids, read as narrowly as the run allows."""

    def __init__(self, data: RunData, size: int) -> None:
        self.data, self.size = data, size
        self.items: dict[str, Item] = {}
        self.parts_read = 0

    def fetch(self, ids: dict[str, Optional[int]]) -> dict[str, Item]:
        """``ids``: sample id -> the part that holds it, when known."""
        todo = {i: p for i, p in ids.items() if i not in self.items}
        if todo:
            self._from_shards(todo)
            todo = {i: p for i, p in todo.items() if i not in self.items}
        if todo:
            self._from_ingest(todo)
        return {i: self.items.setdefault(i, Item(note="not found in this run")) for i in ids}

    def _from_shards(self, ids: dict[str, Optional[int]]) -> None:
        exp = self.data.dirs.get("export")
        index = exp.uri("shards", "index") if exp else None
        if index is None or not storage.exists(index):
            return
        fs, index_path = storage.resolve(index)
        jpg_at, jpg_n, txt_at, txt_n = (f.name for f in (F.SH_JPG_OFFSET, F.SH_JPG_SIZE,
                                                         F.SH_TXT_OFFSET, F.SH_TXT_SIZE))
        cols = [F.SAMPLE_ID.name, F.SH_NAME.name, jpg_at, jpg_n, txt_at, txt_n]
        t = ds.dataset(index_path, format="parquet", filesystem=fs).to_table(
            columns=cols, filter=pc.field(F.SAMPLE_ID.name).isin(list(ids)))
        by_shard: dict[str, list[dict]] = defaultdict(list)
        for r in t.to_pylist():
            by_shard[r[F.SH_NAME.name]].append(r)
        for shard, rows in by_shard.items():
            path = storage.resolve(exp.uri("shards", shard))[1]
            if fs.get_file_info(path).type != pafs.FileType.File:
                continue
            with fs.open_input_file(path) as fh:     # byte ranges: never the whole shard
                for r in sorted(rows, key=lambda r: r[jpg_at]):
                    fh.seek(r[jpg_at])
                    jpg = fh.read(r[jpg_n])
                    fh.seek(r[txt_at])
                    txt = fh.read(r[txt_n]).decode("utf-8", "replace")
                    self.items[r[F.SAMPLE_ID.name]] = Item(txt, None, thumbnail(jpg, self.size))

    def _from_ingest(self, ids: dict[str, Optional[int]]) -> None:
        sd = self.data.dirs.get("ingest")
        if sd is None:
            return
        by_part: dict[int, set[str]] = defaultdict(set)
        unknown = {i for i, p in ids.items() if p is None}
        for i, p in ids.items():
            if p is not None:
                by_part[p].add(i)
        if unknown:  # locate them: only the key column of every part is read
            for p in self.data.parts:
                keys = sd.read(p, [F.SAMPLE_ID.name]).column(0)
                hit = pc.is_in(keys, pa.array(list(unknown), pa.string()))
                found = set(pc.filter(keys, hit).to_pylist())
                if found:
                    by_part[p] |= found
                    unknown -= found
                    if not unknown:
                        break
        have = (self.data.schemas.get("ingest") or pa.schema([])).names
        cols = [c.name for c in (F.SAMPLE_ID, F.CAPTION, F.IMAGE_REF, F.IMAGE) if c.name in have]
        for p, want in sorted(by_part.items()):
            t = sd.read(p, cols)
            t = t.filter(pc.is_in(t.column(F.SAMPLE_ID.name), pa.array(list(want), pa.string())))
            self.parts_read += 1
            for r in t.to_pylist():
                img = r.get(F.IMAGE.name)
                uri = thumbnail(img, self.size)
                note = "" if uri else ("no image" if not img else "undecodable")
                self.items[r[F.SAMPLE_ID.name]] = Item(r.get(F.CAPTION.name),
                                                       r.get(F.IMAGE_REF.name), uri, note)


# --- HTML pieces -------------------------------------------------------------------------------
def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def clip(s: Optional[str], n: int = 140) -> str:
    s = s or ""
    return s if len(s) <= n else s[: n - 1] + "…"


def card(item: Item, label: str = "", cls: str = "", size: int = 112,
         caption: bool = True) -> str:
    if item.uri:
        img = f'<img src="{item.uri}" alt="" width="{size}" height="{size}">'
    else:
        ref = f"<br><small>{esc(clip(item.image_ref, 40))}</small>" if item.image_ref else ""
        img = (f'<div class="noimg" style="width:{size}px;height:{size}px">'
               f'{esc(item.note or "no image")}{ref}</div>')
    cap = esc(clip(item.caption)) if item.caption is not None else "<i>no caption</i>"
    cap = f"<figcaption>{cap}</figcaption>" if caption else ""
    lab = f'<div class="lab">{label}</div>' if label else ""
    return f'<figure class="card {cls}">{img}{lab}{cap}</figure>'


def svg_histogram(values: np.ndarray, *, integer: bool = False, lo: Optional[float] = None,
                  hi: Optional[float] = None, bins: int = 30, marker: Optional[float] = None,
                  marker_label: str = "") -> str:
    """An inline SVG bar chart of ``values`` (counts per bin, axis labels, an optional marker)."""
    W, H, L, B, T = 380, 170, 42, 26, 10
    v = values[np.isfinite(values)]
    lo = float(v.min()) if lo is None else lo
    hi = float(v.max()) if hi is None else hi
    if integer and hi - lo <= 40:
        edges = np.arange(math.floor(lo), math.floor(hi) + 2) - 0.5
    else:
        edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    counts, edges = np.histogram(np.clip(v, edges[0], edges[-1]), bins=edges)
    top = max(int(counts.max()), 1)
    pw, ph = W - L - 8, H - B - T
    x = lambda e: L + (e - edges[0]) / (edges[-1] - edges[0]) * pw  # noqa: E731
    out = [f'<svg class="hist" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'role="img">']
    for c, a, b in zip(counts, edges[:-1], edges[1:]):
        h = c / top * ph
        rng = f"{a + 0.5:.0f}" if integer and b - a == 1 else f"[{a:.3g}, {b:.3g})"
        out.append(f'<rect x="{x(a) + 0.5:.1f}" y="{T + ph - h:.1f}" '
                   f'width="{max(x(b) - x(a) - 1, 1):.1f}" height="{h:.1f}" fill="#3b6fb6">'
                   f'<title>{rng}: {c}</title></rect>')
    out.append(f'<line x1="{L}" y1="{T + ph}" x2="{L + pw}" y2="{T + ph}" stroke="#333"/>')
    out.append(f'<line x1="{L}" y1="{T}" x2="{L}" y2="{T + ph}" stroke="#333"/>')
    out.append(f'<text x="{L - 4}" y="{T + 8}" text-anchor="end">{top}</text>')
    out.append(f'<text x="{L - 4}" y="{T + ph}" text-anchor="end">0</text>')
    ticks = (edges[0] + 0.5, edges[-1] - 0.5) if integer and edges[1] - edges[0] == 1 else \
        (edges[0], edges[-1])
    for t, anchor in ((ticks[0], "start"), (ticks[1], "end")):
        out.append(f'<text x="{x(t) if anchor == "start" else x(edges[-1]):.1f}" y="{H - 8}" '
                   f'text-anchor="{anchor}">{t:.4g}</text>')
    if marker is not None and edges[0] <= marker <= edges[-1]:
        mx = x(marker - 0.5 if integer and edges[1] - edges[0] == 1 else marker)
        out.append(f'<line x1="{mx:.1f}" y1="{T}" x2="{mx:.1f}" y2="{T + ph}" stroke="#c0392b" '
                   f'stroke-dasharray="4 3"/><text x="{mx + 3:.1f}" y="{T + 10}" fill="#c0392b">'
                   f'{esc(marker_label)}</text>')
    out.append("</svg>")
    return "".join(out)


CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:16px 0 6px}.meta{color:#555}.warn{background:#fff3cd;padding:6px 10px;
border-left:4px solid #e0a800;margin:8px 0}.absent{color:#666}
table.funnel{border-collapse:collapse}table.funnel td,table.funnel th{padding:4px 8px;
border-bottom:1px solid #eee;text-align:right;vertical-align:top}table.funnel td.l,
table.funnel th.l{text-align:left}.bar{display:flex;width:220px;height:14px;background:#eee}
.bar .k{background:#2e8b57}.bar .r{background:#c0392b}table.funnel td.reasons{font-size:12px;
text-align:left}
.hists{display:flex;flex-wrap:wrap;gap:18px}.hbox{border:1px solid #ddd;padding:8px}
.hbox .t{font-weight:600}.hbox small{color:#555}svg.hist text{font-size:10px;fill:#333}
.row{display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start;margin:6px 0 14px}
.card{margin:0;width:120px;font-size:11px;border:1px solid #ddd;padding:3px;background:#fafafa}
.card img{display:block;object-fit:contain;background:#000}.card.target{border:2px solid #3b6fb6;
background:#eef3fb}.card .lab{font-weight:600;color:#3b6fb6}.noimg{display:flex;
flex-direction:column;align-items:center;justify-content:center;background:#ddd;color:#555;
text-align:center;font-size:11px}.arrow{align-self:center;font-size:22px;color:#888}
table.rc{border-collapse:collapse}table.rc td{border-bottom:1px solid #eee;padding:6px;
vertical-align:top}table.rc ol{margin:0;padding-left:20px}.flag{color:#999;
text-decoration:line-through}.score{color:#555;font-size:11px}
"""


# --- sections ----------------------------------------------------------------------------------
@dataclass
class Report:
    data: RunData
    images: Images
    sample: int
    pairs: int
    thumb: int
    body: list[str] = field(default_factory=list)
    absent: list[tuple[str, str]] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)

    def section(self, anchor: str, title: str, content: Optional[str],
                why_absent: str = "") -> None:
        if content is None:
            self.absent.append((title, why_absent))
            return
        self.shown.append(title)
        self.body.append(f'<section id="{anchor}"><h2>{esc(title)}</h2>{content}</section>')

    def pick(self, n: int, k: int) -> list[int]:
        return sorted(self.data.rng.choice(n, size=min(n, k), replace=False).tolist()) if n else []

    def pick_nonempty(self, t: pa.Table, field: pa.Field) -> list[dict]:
        """A seeded sample (``self.sample`` rows) of the rows whose list column is non-empty."""
        rows = np.flatnonzero(pc.fill_null(pc.list_value_length(t.column(field.name)), 0).to_numpy())
        return t.take(pa.array(rows[self.pick(rows.size, self.sample)])).to_pylist() if rows.size else []

    def card(self, item: Item, label: str = "", cls: str = "", caption: bool = True) -> str:
        return card(item, label, cls, self.thumb, caption)


def funnel(r: Report) -> Optional[str]:
    d = r.data
    rows = []
    for name in d.names:
        m = d.manifests.get(name)
        if m is None:
            att = d.dirs[name].attempt()
            state = (f'incomplete: {len(d.dirs[name].committed())}/{att.get("parts", "?")} parts '
                     'committed') if att else "not run"
            rows.append(f'<tr><td class="l">{esc(name)}</td><td colspan="6" class="l">{state}'
                        '</td></tr>')
            continue
        n_in = max(int(m[F.MK.ROWS_IN]), 1)
        k, rj = int(m[F.MK.ROWS_KEPT]), int(m[F.MK.ROWS_REJECTED])
        reasons = ", ".join(f"{esc(code)} <b>{n}</b>" for code, n in
                            sorted(m[F.MK.REASON_COUNTS].items(), key=lambda kv: (-kv[1], kv[0])))
        rows.append(
            f'<tr><td class="l">{esc(name)}</td><td>{m["parts"]}</td><td>{m[F.MK.ROWS_IN]}</td>'
            f'<td>{k}</td><td>{rj}</td><td><div class="bar" title="kept {k}, rejected {rj}">'
            f'<div class="k" style="width:{100 * k / n_in:.1f}%"></div>'
            f'<div class="r" style="width:{100 * rj / n_in:.1f}%"></div></div></td>'
            f'<td class="reasons">{reasons}</td><td>{m[F.MK.WALL_S]:.1f}s</td></tr>')
    if not any(d.manifests.values()) and not any(d.dirs[n].attempt() for n in d.names):
        return None
    head = ('<table class="funnel"><tr><th class="l">stage</th><th>parts</th><th>rows in</th>'
            '<th>kept</th><th>rejected</th><th class="l">kept / rejected</th>'
            '<th class="l">rejected by reason</th><th>wall</th></tr>')
    note = ('<p class="meta">rows in: rows still kept when they reached the stage. A row can carry '
            'several reasons, so the reason counts may add up to more than the rejected rows.</p>')
    return head + "".join(rows) + "</table>" + note


HISTOGRAMS = [
    # (title, field, integer, fixed range, marker config key, marker label)
    ("Caption complexity (CAT; -1 = no object)", CS.CAT_COMPLEXITY, True, None,
     ("cat", "min_complexity"), "min_complexity"),
    ("OCR confidence of each spotted text line", CS.OCR_CONFS, False, (0.0, 1.0),
     ("textspot", "min_conf"), "min_conf"),
    ("Hard-pair scores (HPM)", M.HARD_SCORES, False, None, None, ""),
    ("Hard-pair support (pairs with a positive score)", M.SUPPORT, True, None, ("hpm", "k"),
     "k (fewer: noise pair)"),
    ("Recaption sequence scores", RC.RECAPTION_SCORES, False, None, None, ""),
    ("Cross-modal score (embed.cross_model)", E.CROSS_SCORE, False, None,
     ("policy", "cut_score", "min_score"), "export cut"),
]


def marker_value(d: RunData, key: tuple) -> Any:
    """A histogram's marker: a config value (section, name), or the first of the names the shard
    manifest's policy records ("policy", names...: where export's score cut fell)."""
    if key[0] == "policy":
        return next((d.policy[k] for k in key[1:] if d.policy.get(k) is not None), None)
    return (d.config.get(key[0]) or {}).get(key[1])


def histograms(r: Report) -> None:
    boxes, missing = [], []
    for title, f, integer, rng, marker_key, marker_label in HISTOGRAMS:
        v = r.data.values(f)
        if v is None:
            missing.append(f"{f.name}")
            r.absent.append((f"Histogram: {title}", f"no stage table has the column {f.name}"))
            continue
        if v.size == 0:
            boxes.append(f'<div class="hbox"><div class="t">{esc(title)}</div><p class="meta">'
                         f'{f.name}: no values in the sampled rows (all null or empty)</p></div>')
            continue
        marker = marker_value(r.data, marker_key) if marker_key else None
        marker = float(marker) if isinstance(marker, (int, float)) else None
        lo, hi = rng if rng else (None, None)
        svg = svg_histogram(v, integer=integer, lo=lo, hi=hi, marker=marker,
                            marker_label=f"{marker_label} = {marker:.4g}" if marker is not None
                            else "")
        boxes.append(f'<div class="hbox"><div class="t">{esc(title)}</div>{svg}<br><small>'
                     f'{f.name}: n={v.size}, mean {v.mean():.3g}, median {np.median(v):.3g}, '
                     f'min {v.min():.3g}, max {v.max():.3g}</small></div>')
    if boxes:
        r.shown.append("Histograms")
        r.body.append('<section id="histograms"><h2>Histograms</h2><div class="hists">'
                      + "".join(boxes) + "</div></section>")


# The sections below that show images are generators: they pick their rows, yield the sample ids
# they need (id -> part, when known), receive the fetched items, and return their HTML (None when
# the run lacks their columns). render() fetches every section's images in one pass, so an ingest
# part is read once however many sections show rows from it.
Section = Generator[dict, dict, Optional[str]]


def neighbour_grid(r: Report, ids_f: pa.Field, scores_f: pa.Field, extra_f: Optional[pa.Field],
                   what: str) -> Section:
    t = r.data.sample(ids_f, scores_f, *([extra_f] if extra_f else []))
    if t is None:
        return None
    lens = pc.fill_null(pc.list_value_length(t.column(ids_f.name)), 0).to_numpy()
    rows = np.flatnonzero(lens > 0)
    if rows.size == 0:
        return (f'<p class="meta">No row in the sampled parts has {what} ({ids_f.name} is empty '
                'or null).</p>')
    chosen = t.take(pa.array(rows[r.pick(rows.size, r.sample)])).to_pylist()
    want: dict[str, Optional[int]] = {}
    for row in chosen:
        want[row[F.SAMPLE_ID.name]] = row[PART_COL]
        for i in row[ids_f.name][: r.pairs]:
            want.setdefault(i, None)
    items = yield want
    out = [f'<p class="meta">{len(chosen)} random targets of the {rows.size} rows with {what} in '
           f'the sampled parts; each target (blue) is followed by its first {r.pairs} {what}, '
           'best first.</p>']
    for row in chosen:
        sid = row[F.SAMPLE_ID.name]
        cards = [r.card(items[sid], f"target {esc(sid)}", "target"), '<span class="arrow">→</span>']
        extra = row.get(extra_f.name) if extra_f else None
        for j, (i, s) in enumerate(zip(row[ids_f.name][: r.pairs], row[scores_f.name] or [])):
            lab = f"#{j + 1} score {s:.3f}" + (f" · {esc(extra[j])}" if extra else "")
            cards.append(r.card(items[i], lab))
        n = len(row[ids_f.name])
        more = f'<span class="meta">+{n - r.pairs} more</span>' if n > r.pairs else ""
        out.append(f'<div class="row">{"".join(cards)}{more}</div>')
    return "".join(out)


def rejected_examples(r: Report, per_reason: int, max_rows: int = 200_000) -> Section:
    d = r.data
    stages = [n for n in d.names if n != "export"
              and (d.manifests.get(n) or {}).get(F.MK.ROWS_REJECTED)]
    if not stages:
        return None
    want = {(n, code): cnt for n in stages for code, cnt in d.manifests[n][F.MK.REASON_COUNTS].items()}
    found: dict[tuple, list[dict]] = defaultdict(list)
    read = 0
    order = [(n, p) for n in stages for p in _parts_with_rejects(d.dirs[n])]
    for k in d.rng.permutation(len(order)):
        n, part = order[k]
        t = d.dirs[n].read(part, [F.SAMPLE_ID.name, F.REASONS.name, F.REASON_DETAIL.name],
                           kind="rejects")
        read += t.num_rows
        rows = t.to_pylist()
        for j in d.rng.permutation(len(rows)):
            row = rows[j]
            for code in row[F.REASONS.name] or []:
                if len(found[(n, code)]) < per_reason:
                    found[(n, code)].append({**row, "part": part})
        if read >= max_rows or all(len(found[w]) >= per_reason for w in want):
            break
    items = yield {row[F.SAMPLE_ID.name]: row["part"] for rows in found.values() for row in rows}
    out = [f'<p class="meta">Up to {per_reason} random rows per reason code, from the rejects '
           "tables (every stage but export). The detail line is the stage's own explanation.</p>"]
    for (n, code), cnt in sorted(want.items(), key=lambda kv: -kv[1]):
        rows = found.get((n, code), [])
        cards = "".join(r.card(items[x[F.SAMPLE_ID.name]], esc(clip(x[F.REASON_DETAIL.name], 90)))
                        for x in rows) or "<i>no example found in the rows read</i>"
        out.append(f'<h3>{esc(code)} <span class="meta">({cnt} row{"s" if cnt != 1 else ""}, '
                   f'stage {esc(n)})</span></h3>'
                   f'<div class="row">{cards}</div>')
    return "".join(out)


def _parts_with_rejects(sd: StageDir) -> list[int]:
    """The committed parts that have rejects (one LIST of the stage's rejects folder)."""
    listed = {int(i.path.split("/")[-2].split("-")[1]) for i in storage.list_files(sd.rejects)}
    return sorted(listed & set(sd.committed()))


def recaptions(r: Report) -> Section:
    t = r.data.sample(RC.RECAPTIONS, RC.RECAPTION_SCORES, RC.RECAPTION_FLAGS, RC.RECAPTION_RANDOM)
    if t is None:
        return None
    chosen = r.pick_nonempty(t, RC.RECAPTIONS)
    if not chosen:
        return '<p class="meta">No row in the sampled parts was recaptioned.</p>'
    items = yield {x[F.SAMPLE_ID.name]: x[PART_COL] for x in chosen}
    out = []
    if any(x[RC.RECAPTION_RANDOM.name] for x in chosen):
        out.append('<p class="warn">The captioner ran with RANDOM weights: these recaptions are '
                   'noise, for testing only.</p>')
    out.append('<table class="rc"><tr><th></th><th>original caption</th><th>recaptions (best score '
               'first; struck through: flagged)</th></tr>')
    for x in chosen:
        it = items[x[F.SAMPLE_ID.name]]
        lis = []
        for cap, s, flag in zip(x[RC.RECAPTIONS.name], x[RC.RECAPTION_SCORES.name] or [],
                                x[RC.RECAPTION_FLAGS.name] or [None] * len(x[RC.RECAPTIONS.name])):
            cls = ' class="flag"' if flag else ""
            lis.append(f'<li><span{cls}>{esc(clip(cap, 160))}</span> <span class="score">{s:.3f}'
                       f'{" · " + esc(flag) if flag else ""}</span></li>')
        out.append(f'<tr><td>{r.card(it, caption=False)}</td>'
                   f'<td>{esc(clip(it.caption, 200))}</td><td><ol>{"".join(lis)}</ol></td></tr>')
    return "".join(out) + "</table>"


def concepts(r: Report) -> Section:
    t = r.data.sample(CO.CONCEPT_OBJECT_IDS, CO.CONCEPT_OBJECT_PROBS, CO.CONCEPT_ATTRIBUTE_IDS,
                      CO.CONCEPT_ATTRIBUTE_PROBS)
    if t is None:
        return None
    stage = r.data.where(CO.CONCEPT_OBJECT_IDS)
    fs, vocab_path = storage.resolve(r.data.dirs[stage].uri("vocab.parquet"))
    names: dict[tuple[str, int], str] = {}
    if fs.get_file_info(vocab_path).type == pafs.FileType.File:
        v = pq.read_table(vocab_path, filesystem=fs,
                          columns=[CO.V_KIND.name, CO.V_ID.name, CO.V_SYNSET.name])
        names = {(k, i): s for k, i, s in zip(*(v.column(c).to_pylist() for c in v.column_names))}
    chosen = r.pick_nonempty(t, CO.CONCEPT_OBJECT_IDS)
    if not chosen:
        return '<p class="meta">No row in the sampled parts has concept targets.</p>'
    items = yield {x[F.SAMPLE_ID.name]: x[PART_COL] for x in chosen}

    def fmt(kind: str, ids: Optional[list], probs: Optional[list]) -> str:
        return ", ".join(f"{esc(names.get((kind, i), f'#{i}'))} {p:.2f}"
                         for i, p in zip(ids or [], probs or [])) or "—"
    out = ['<table class="rc"><tr><th></th><th>caption</th><th>top objects</th>'
           '<th>top attributes</th></tr>']
    for x in chosen:
        it = items[x[F.SAMPLE_ID.name]]
        objs = fmt("object", x[CO.CONCEPT_OBJECT_IDS.name], x[CO.CONCEPT_OBJECT_PROBS.name])
        attrs = fmt("attribute", x[CO.CONCEPT_ATTRIBUTE_IDS.name],
                    x[CO.CONCEPT_ATTRIBUTE_PROBS.name])
        out.append(f'<tr><td>{r.card(it, caption=False)}</td>'
                   f'<td>{esc(clip(it.caption, 200))}</td>'
                   f'<td>{objs}</td><td>{attrs}</td></tr>')
    return "".join(out) + "</table>"


def random_weight_notes(d: RunData) -> list[str]:
    out = []
    for f, what in ((E.RANDOM_WEIGHTS, "an embed encoder"), (RC.RECAPTION_RANDOM, "the captioner"),
                    (CO.CONCEPT_RANDOM, "the concept teacher")):
        v = d.values(f)
        if v is not None and v.size and v.any():
            out.append(f"{what} ran with RANDOM weights ({f.name}): its outputs are for "
                       "testing only")
    return out


# --- the page ----------------------------------------------------------------------------------
def render(run_dir: Any, *, sample: int = 8, pairs: int = 8, per_reason: int = 6,
           thumb: int = 112, stats_rows: int = 200_000, seed: int = 0) -> tuple[str, dict]:
    """The report's HTML and a summary (sections shown and absent, rows sampled, timings)."""
    t0 = time.time()
    d = RunData(str(run_dir), stats_rows, seed)
    r = Report(d, Images(d, thumb), sample, pairs, thumb)
    r.section("funnel", "Funnel", funnel(r), "no stage has a manifest")
    histograms(r)
    not_run = "no stage table has the column {} (the {} stage did not run)".format
    sections = [
        ("hard-pairs", "Hard pairs of random targets",
         neighbour_grid(r, M.HARD_IDS, M.HARD_SCORES, None, "hard pairs"),
         not_run(M.HARD_IDS.name, "hpm")),
        ("positives", "Positives of random targets (FFF / near-duplicates)",
         neighbour_grid(r, M.POSITIVE_IDS, M.POSITIVE_SCORES, M.POSITIVE_RELATIONS, "positives"),
         not_run(M.POSITIVE_IDS.name, "positives")),
        ("rejected", "Rejected examples by reason", rejected_examples(r, per_reason),
         "no stage rejected any row"),
        ("recaptions", "Recaptions beside the original captions", recaptions(r),
         not_run(RC.RECAPTIONS.name, "recaption")),
        ("concepts", "Concept targets", concepts(r),
         not_run(CO.CONCEPT_OBJECT_IDS.name, "concepts")),
    ]
    planned, want = [], {}
    for anchor, title, gen, why in sections:
        try:
            ids = next(gen)
        except StopIteration as done:   # nothing to show, or nothing that needs an image
            planned.append((anchor, title, None, done.value, why))
            continue
        want.update({i: p for i, p in ids.items() if want.get(i) is None})
        planned.append((anchor, title, gen, None, why))
    items = r.images.fetch(want)
    for anchor, title, gen, content, why in planned:
        r.section(anchor, title, content if gen is None else _finish(gen, items, anchor), why)
    page = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>vlcurate report: "
            f"{esc(d.run_dir.rstrip('/').rsplit('/', 1)[-1])}</title><style>{CSS}</style></head>"
            "<body>" + "".join(_head(r, seed)) + "".join(r.body) + "</body></html>")
    info = {"shown": r.shown, "absent": [t for t, _ in r.absent], "stat_parts": len(d.stat_parts),
            "parts": len(d.parts), "ingest_parts_read": r.images.parts_read,
            "seconds": round(time.time() - t0, 3)}
    return page, info


def _finish(gen: Generator, items: dict, anchor: str) -> Optional[str]:
    """Send a section the images it asked for; its content."""
    try:
        gen.send(items)
    except StopIteration as done:
        return done.value
    raise AssertionError(f"section {anchor} yielded twice")


def _head(r: Report, seed: int) -> list[str]:
    d = r.data
    head = [f"<h1>vlcurate report</h1><div class='meta'>run <code>{esc(display(d.run_dir))}</code>"
            f" · stages {esc(', '.join(d.names))} · generated "
            f"{dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}</div>"]
    ing, exp = d.manifests.get("ingest"), d.manifests.get("export")
    line = []
    if ing:
        line.append(f"{ing[F.MK.ROWS]} source rows")
    if exp:
        line.append(f"{exp[F.MK.ROWS_KEPT]} kept by the export policy")
        sm = read_json(d.dirs["export"].uri("shards", "manifest.json"))
        if sm:
            held = "" if sm.get("layout") != "image" else f" holding {sm.get(F.SH_ROWS.name)} rows"
            line.append(f"{sm['samples']} samples{held} in {sm['shards']} shards "
                        f"(drop={esc(sm['policy']['drop'])})")
    if line:
        head.append(f"<p><b>{' · '.join(line)}</b></p>")
    head.append(f'<p class="meta">Histograms and samples read {len(d.stat_parts)} of '
                f'{len(d.parts)} parts (about {d.stat_rows} of {d.total_rows} rows, '
                f'seed {seed}).</p>')
    head += [f'<p class="warn">{esc(n)}</p>' for n in random_weight_notes(d)]
    if r.absent:
        head.append("<p class='absent'><b>Not in this run:</b></p><ul class='absent'>" + "".join(
            f"<li>{esc(t)}: {esc(w)}</li>" for t, w in r.absent) + "</ul>")
    return head


def write_report(run_dir: Any, out: Any = None, **kw: Any) -> tuple[Any, dict]:
    """Render and write the report (a path or URI; default: report.html in the run directory);
    (where it went: a Path when local, else the URI, and the summary with its size)."""
    page, info = render(run_dir, **kw)
    uri = str(out) if out else storage.join(str(run_dir), "report.html")
    data = page.encode("utf-8")
    storage.write_bytes(uri, data)
    info["bytes"] = len(data)
    return (Path(storage.local_path(uri)) if storage.is_local(uri) else uri), info


__all__ = ["render", "write_report", "svg_histogram", "thumbnail", "ReportError"]
