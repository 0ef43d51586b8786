"""What the engine writes and reads: the layout (``save_layout``, ``load_layout``) and the
vectors sorted by it (``save_vectors``, ``load_vectors``: ``<name>.f32`` and the precision's
low copy), which every worker memory-maps; ``sorted_vectors`` makes the same in memory."""
from __future__ import annotations

import os
from contextlib import ExitStack

import numpy as np
import torch

from ..hpm import as_tensor
from .core import NAMES, Vectors
from .kernels import mapped
from .layout import Layout
from .precision import get, registry


def sorted_vectors(lay: Layout, img, txt, ximg=None, xtxt=None, precision: str = "fp32"
                   ) -> Vectors:
    """In-memory copies in layout order, with their ``precision`` copies as the stage stores
    them (tests, the benchmark; the stage memory-maps them: save_vectors)."""
    out = [None if x is None else take_rows(x, lay.order) for x in (img, txt, ximg, xtxt)]
    prec = get(precision)
    low = {n: c for n, c in ((n, None if x is None else prec.low_copy(x, lay))
                             for n, x in zip(NAMES, out)) if c is not None}
    return Vectors(*out, low=low or None)


def take_rows(x, rows: np.ndarray) -> np.ndarray:
    """x[rows] as a float32 array: by torch's index_select where x is float32 and contiguous
    (an array or a memmap, shared: ~4x NumPy's fancy indexing of 1.5 KB rows, 1.0 against
    3.9 s for 1M rows), else NumPy's."""
    if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous:
        return as_tensor(x, "cpu").index_select(0, torch.as_tensor(rows)).numpy()
    return np.ascontiguousarray(np.asarray(x)[rows], np.float32)


def save_vectors(dir_: str, lay: Layout, arrays: dict, precision: str = "fp32",
                 chunk: int = 65536) -> None:
    """Write each [N, d] array of ``arrays`` (keys in NAMES) in layout order, float32
    (``<name>.f32``), and with a low ``precision`` its copy in that precision too (the
    precision's copy_writer: ``<name>.bf16``, ...), whole clusters at a time."""
    os.makedirs(dir_, exist_ok=True)
    prec = get(precision)
    for name, x in arrays.items():
        if x is None:
            continue
        with ExitStack() as stack:
            f32 = stack.enter_context(open(os.path.join(dir_, f"{name}.f32"), "wb"))
            low = prec.copy_writer(dir_, name, lay)
            if low is not None:
                stack.callback(low.close)
            for a, b in _cluster_chunks(lay, chunk):
                rows = lay.order[a:b]
                block = take_rows(take_rows(x, np.sort(rows)), np.argsort(np.argsort(rows)))
                f32.write(block.tobytes())
                if low is not None:
                    low.write(block, a, b)
        with open(os.path.join(dir_, f"{name}.dim"), "w") as fh:
            fh.write(str(x.shape[1]))


def _cluster_chunks(lay: Layout, chunk: int):
    """(a, b): sorted positions of about ``chunk`` rows, each cut at a cluster's start."""
    n = len(lay.order)
    cuts = np.unique(np.r_[lay.bounds[np.searchsorted(lay.bounds, np.arange(0, n, chunk),
                                                      side="right") - 1], n])
    return zip(cuts[:-1].tolist(), cuts[1:].tolist())


def load_vectors(dir_: str, n: int) -> Vectors:
    """The sorted vectors in ``dir_`` (save_vectors'), memory-mapped, with their low copy."""
    out, low = [], {}
    for name in NAMES:
        path = os.path.join(dir_, f"{name}.f32")
        if not os.path.exists(path):
            out.append(None)
            continue
        with open(os.path.join(dir_, f"{name}.dim")) as fh:
            d = int(fh.read())
        out.append(mapped(path, np.float32, (n, d)) if n else np.zeros((0, d), np.float32))
        for prec in registry().values():          # the copy save_vectors wrote, if any
            got = prec.load_copy(dir_, name, n, d)
            if got is not None:
                low[name] = got
    return Vectors(*out, low=low or None)


LAYOUT = ("means", "radius", "order", "bounds")


def save_layout(dir_: str, lay: Layout) -> None:
    os.makedirs(dir_, exist_ok=True)
    for f in LAYOUT:
        np.save(os.path.join(dir_, f"{f}.npy"), getattr(lay, f))
    np.save(os.path.join(dir_, "positions.npy"), lay.positions())


def load_layout(dir_: str) -> tuple[Layout, np.ndarray]:
    """The layout (its order memory-mapped) and the sorted position of each global row."""
    lay = Layout(*(_npy(os.path.join(dir_, f"{f}.npy"), f == "order") for f in LAYOUT))
    return lay, _npy(os.path.join(dir_, "positions.npy"), True)


def _npy(path: str, as_map: bool) -> np.ndarray:
    """A saved array: read whole, or memory-mapped (read-only) as a plain ndarray view
    (``mapped``'s reason: cheap slices)."""
    return np.asarray(np.load(path, mmap_mode="r")) if as_map else np.load(path)
