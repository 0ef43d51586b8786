"""A model a CAT stage can run without: the spaCy pipeline (``cat``) or the OCR backend
(``textspot``). A part that cannot run is skipped only when the config says ``if_missing: skip``:
every row then says so in ``cat_skipped`` / ``textspot_skipped``, and the stage's ``finalize``
returns and writes it (``<stage>/status.json``) for the run summary. Each worker decides in its
``setup()``; they agree, since the installed pipeline or backend enters the stage's fingerprint
(``environment``) and every node runs the same image."""
from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional

import pyarrow as pa

from vlcurate.schemas import F, conform

from . import parser as P
from . import textspot as T


def decide(load: Callable[[], Any], if_missing: str, part: str) -> tuple[Any, Optional[str]]:
    """(loaded thing, None) or, when it cannot load and the config allows it, (None, skip note)."""
    try:
        return load(), None
    except (P.PipelineMissing, T.BackendUnavailable) as e:
        if if_missing != "skip":
            raise
        return None, f"{part} skipped: {getattr(e, 'short', e)}"


def skipped_table(ids: Any, column: pa.Field, note: str, schema: pa.Schema) -> pa.Table:
    """Every row: no annotations, no reasons, and the note saying what was skipped."""
    return conform(pa.table({F.SAMPLE_ID.name: ids, column.name: [note] * len(ids),
                             F.REASONS.name: pa.array([[]] * len(ids), F.REASONS.type)}), schema)


def skip_notes(part: int, read: Any, stage: str, column: str) -> set:
    return {n for n in read(stage, part, [column]).column(column).to_pylist() if n}


def skip_status(ctx: Any, stage: str, column: str, extra: Optional[dict] = None) -> dict:
    """Which parts were skipped in this run (read back from the table), written to status.json."""
    notes = ctx.map(functools.partial(skip_notes, read=ctx.read, stage=stage, column=column),
                    list(range(len(ctx.counts))))
    info = {"skipped": sorted(set().union(*notes)), **(extra or {})}
    ctx.write_bytes("status.json", json.dumps(info, indent=1).encode())
    return info
