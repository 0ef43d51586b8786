"""Per-image work once per distinct image: within a call (``once_per_image``), and across the
parts of a run (the image pass, ``pipeline/homes.py``).

Within a call, the rows of one image (COCO and Flickr give five captions per image) share one
OCR pass, one embedding, one set of recaptions. Across parts, an image whose rows lie in several
parts (a shuffled source: img2dataset writes one file per caption row) is computed once, in its
*home* part, by a first pass of the stage that ``records`` what ``once_per_image`` computes; the
stage's real pass then ``replays`` those results to every row of the image, in any part. The
runner sets both through ``image_pass`` around each call (``pipeline/parts.py``); a stage sees
no difference, except that ``recording()`` tells text spotting to read the whole image (the
home pass does not know the captions of the image's other parts, so it cannot stop early).
"""
from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

# distinct images each stage class computed in this process (the key: the class that called
# once_per_image): how the per-image stages' calls per image are counted (bench_groups.py)
COMPUTED: Counter = Counter()


@dataclass
class ImagePass:
    """One call of a stage on ``rows`` rows. ``replay``: per row, the results its image's home
    computed (one per ``once_per_image`` call of the stage, in order), or None; ``recorded``
    (the home pass): per ``once_per_image`` call, its result for each row (None: the call was
    not on the batch's rows); ``per_call``: the distinct images each call computed."""
    rows: int
    replay: Optional[list] = None
    recorded: Optional[list] = None
    per_call: list = field(default_factory=list)

    @property
    def calls(self) -> int:
        return len(self.per_call)

    @property
    def computed(self) -> int:
        """Distinct images computed: those of its busiest call (embed encodes each image with
        two models, one call each)."""
        return max(self.per_call, default=0)

    def row_values(self, i: int) -> Optional[tuple]:
        """Row ``i``'s results, one per call, as the home pass hands them on."""
        if self.recorded is None or any(r is None for r in self.recorded):
            return None
        return tuple(r[i] for r in self.recorded)


_PASS: contextvars.ContextVar = contextvars.ContextVar("image_pass", default=None)


@contextlib.contextmanager
def image_pass(rows: int, replay: Optional[list] = None, record: bool = False
               ) -> Iterator[ImagePass]:
    ctx = ImagePass(rows, replay, [] if record else None)
    token = _PASS.set(ctx)
    try:
        yield ctx
    finally:
        _PASS.reset(token)


def recording() -> bool:
    """In the home pass: the results are for every row of the image in the run."""
    ctx = _PASS.get()
    return ctx is not None and ctx.recorded is not None


def _replayed(ctx: Optional[ImagePass], images: Sequence[bytes], index: dict) -> dict[int, Any]:
    """{distinct image: its replayed result} for this call (the ``ctx.calls``-th)."""
    if ctx is None or ctx.replay is None or len(images) != ctx.rows:
        return {}
    out = {}
    for b, values in zip(images, ctx.replay):
        if values is not None and len(values) > ctx.calls:
            out.setdefault(index[b], values[ctx.calls])
    return out


def once_per_image(images: Sequence[bytes], compute: Callable[[list[bytes]], list],
                   cache: Any = None, hashes: Optional[Sequence[str]] = None) -> list:
    """``compute`` on each distinct image once, fanned back out to every row that shows it.
    Rows are grouped by their bytes (equal bytes, equal ``image_hash``), in order of first
    appearance, so the result depends only on the batch (and on the results replayed to it).
    With a ``cache`` (``stages/cache.py``) and the rows' ``hashes``, images it holds are not
    computed at all."""
    from .cache import cached
    if cache is not None and (hashes is None or len(hashes) != len(images)):
        raise ValueError("once_per_image: a cache needs every row's image hash")
    ctx = _PASS.get()
    index: dict[bytes, int] = {}
    first = [index.setdefault(b, len(index)) for b in images]
    distinct = list(index)
    keys = [""] * len(distinct)
    for b, h in zip(images, hashes or ()):
        keys[index[b]] = h
    results = _replayed(ctx, images, index)
    todo = [i for i in range(len(distinct)) if i not in results]
    counter = getattr(compute, "__qualname__", "").split(".")[0]

    done = [0]

    def counted(picked: list[int]) -> list:
        COMPUTED[counter] += len(picked)
        done[0] += len(picked)
        return compute([distinct[todo[i]] for i in picked])
    fresh = cached(cache, [keys[i] for i in todo], counted) if todo else []
    if len(fresh) != len(todo):
        raise RuntimeError(f"{len(fresh)} results for {len(todo)} distinct images")
    results.update(zip(todo, fresh))
    out = [results[i] for i in first]
    if ctx is not None:
        if ctx.recorded is not None:
            ctx.recorded.append(out if len(images) == ctx.rows else None)
        ctx.per_call.append(done[0])
    return out


def count_again(counter: str, n: int) -> None:
    """``n`` images computed again outside ``once_per_image`` (text spotting re-reads an image
    whose cached read stopped before a row's caption was settled): counted as computed."""
    COMPUTED[counter] += n
    ctx = _PASS.get()
    if ctx is not None and ctx.per_call:
        ctx.per_call[-1] += n
