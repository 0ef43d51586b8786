"""The run summary: one line per stage, and the check rows in = rows kept + rows rejected."""
from __future__ import annotations

from typing import Iterable

from vlcurate.schemas import F


def _top(reasons: dict, n: int = 3) -> str:
    items = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    s = ", ".join(f"{k} {v}" for k, v in items[:n])
    return s + (f", +{len(items) - n} more" if len(items) > n else "")


def problems(results: list) -> list[str]:
    """Accounting checks: nothing is lost between stages, and every row is kept or rejected."""
    out = []
    ms = [r.manifest for r in results]
    for m in ms:
        if m[F.MK.ROWS_IN] != m[F.MK.ROWS_KEPT] + m[F.MK.ROWS_REJECTED]:
            out.append(f"{m['stage']}: rows in {m[F.MK.ROWS_IN]} != kept {m[F.MK.ROWS_KEPT]} + "
                       f"rejected {m[F.MK.ROWS_REJECTED]}")
        if ms and m[F.MK.ROWS] != ms[0][F.MK.ROWS]:
            out.append(f"{m['stage']}: {m[F.MK.ROWS]} rows but the source gave {ms[0][F.MK.ROWS]}")
    for r in results:
        info = r.info if isinstance(r.info, dict) else {}
        out += [f"{r.manifest['stage']}: {lost}"
                for lost in (info.get("second_count") or {}).get("lost", [])]
        if info.get("samples") is not None:
            out += [f"{r.manifest['stage']}: {p}"
                    for p in shard_problems(info, r.manifest[F.MK.ROWS_KEPT])]
    return out


def shard_problems(shards: dict, kept: int) -> list[str]:
    """The shards hold every kept row once, in either layout (``export.layout``): the rows the
    shards' samples hold (``rows``: pair, one a sample; image, the captions of each image
    sample) are the kept rows, and a pair sample is one row."""
    rows, samples, layout = shards.get(F.SH_ROWS.name), shards["samples"], shards.get("layout")
    out = []
    if rows != kept:
        out.append(f"{rows} rows in shards ({samples} samples, layout {layout}) but {kept} kept")
    if layout == "pair" and samples != rows or samples > (rows or 0):
        out.append(f"{samples} samples in shards hold {rows} rows (layout {layout})")
    return out


def _second_count(results: list) -> list[str]:
    """What the sources' second count (counted without the readers) covered."""
    books = next((r.info["second_count"] for r in results
                  if isinstance(r.info, dict) and "second_count" in r.info), None)
    if books is None:
        return []
    said = f"  (ingest's rows checked against the sources' second count: {books['records']} " \
           f"records in {books['units'] - books['bounded']} files"
    said += f"; {books['bounded']} malformed file(s) within bounds" if books["bounded"] else ""
    if books["unchecked"]:
        said += f"; sampled sources not checked: {', '.join(books['unchecked'])}"
    return [said + ")"]


def _images(results: list) -> list[str]:
    """Each per-image stage's images computed against the distinct images it had to compute."""
    said = [f"{r.manifest['stage']} {n['computed']:,} of {n['distinct']:,}" for r in results
            if isinstance(r.info, dict) and (n := r.info.get("images"))]
    return [f"  (images computed, of the distinct images: {'; '.join(said)})"] if said else []


def format_summary(results: Iterable) -> str:
    rows = [("stage", "status", "parts", "rows", "in", "kept", "rejected", "wall", "top reasons")]
    results = list(results)
    for r in results:
        m = r.manifest
        rows.append((m["stage"], r.status + (f" ({m[F.MK.PARTS_REUSED]} reused)" if m[F.MK.PARTS_REUSED]
                                             and r.status in ("resumed", "repaired") else ""),
                     str(m["parts"]), str(m[F.MK.ROWS]), str(m[F.MK.ROWS_IN]), str(m[F.MK.ROWS_KEPT]),
                     str(m[F.MK.ROWS_REJECTED]), f"{m[F.MK.WALL_S]:.1f}s", _top(m[F.MK.REASON_COUNTS])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i in (0, 1, 8) else c.rjust(w)
                       for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    for title, key in (("WARNING:", "warnings"), ("NOTE:", "notes")):
        said = [n for r in results for n in (r.info or {}).get(key, [])]
        if said:
            lines += ["", title] + [f"  * {n}" for n in said]
    bad = problems(results)
    lines.append("rows in = rows kept + rows rejected for every stage, no row lost: "
                 + ("yes" if not bad else "NO (a bug: please report it)"))
    lines += _second_count(results) + _images(results)
    lines += [f"  ! {p}" for p in bad]
    return "\n".join(lines)
