"""What every part of the mining engine shares: the pass's parameters, the names of the
sorted vectors and of a candidate pair's similarities, the sorted vectors a unit reads, and
the heap settings a chunk is mined under."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from vlcurate.foundation import heap

from ..hpm import as_tensor


# while a chunk is mined: M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD
_KEEP = {heap.M_MMAP_THRESHOLD: 32 << 20, heap.M_TRIM_THRESHOLD: 256 << 20,
         heap.M_TOP_PAD: 64 << 20}


def freed_memory_kept():
    """glibc, while a chunk is mined: blocks under 32 MB come from the heap, and up to 256 MB
    freed at its top stay there. By default every tensor over ~128 KB is a fresh mmap whose
    pages fault in again, and the pass makes thousands of ~1 MB temporaries per chunk: ~15%
    of its time per target (1M synthetic). Speed only. On exit the enclosing settings come back
    (foundation/heap.py: left set, every later stage of an in-process run held ~0.5 GB more:
    bench_scale at 100k) and the free memory is given back (malloc_trim)."""
    return heap.heap_settings(_KEEP, trim=True)


# a candidate pair's similarities: S_I, S_T (HELIP's encoders), and with cross-modal vectors the
# directed S_it = <x_i, t_j>, X_ii = <x_i, x_j>, X_tt = <t_i, t_j> (NaN without them)
SIMS = ("sii", "stt", "sit", "xii", "xtt")
PAIR_FIELDS = ("q", "j") + SIMS
NAMES = ("img", "txt", "ximg", "xtxt")     # the sorted vectors (files img.f32, ...)


@dataclass(frozen=True)
class PassParams:
    k: int
    tau_i: float
    tau_t: float
    dup: Optional[float] = 0.98
    floor_i: float = 2.0           # keep pairs with S_I > floor_i (2.0: none)
    floor_t: float = 2.0
    floor_x: float = 2.0           # S_it > floor_x (needs cross-modal vectors; X_ii and X_tt
                                   # are held to floor_i and floor_t)
    n_clusters: Optional[int] = None   # None: auto (clusters of about cluster_rows rows)
    probe: int = 40                # clusters searched per query (all: exhaustive)
    iters: int = 6                 # k-means iterations: 10 -> 6 cost 0.0004 of recall@10 on
                                   # 2,000 exact targets of the 1M synthetic set (probe 60:
                                   # 0.9934 -> 0.9930; 4: 0.9920) and ~40% of k-means' time
    sample: int = 64               # k-means training rows per cluster
    seed: int = 0
    query_block: int = 1024
    block_size: int = 8192
    max_pairs: Optional[int] = None    # candidate pairs kept per row (highest similarity first)
    precision: str = "fp32"        # a name in precision.registry(): the blocks' arithmetic
    space_probe: int = 0           # one-space layouts' clusters searched per row (spaces.py;
                                   # 0: none)
    cluster_rows: int = 2048       # the auto cluster size
    space_rows: int = 512          # the one-space layouts' cluster size (spaces.py)
    exact_noise: bool = True       # complete the support of rows found short (``complete``):
                                   # noise decisions equal exact HPM's

    def floors(self) -> dict:
        """Each similarity's candidate floor (X_ii and X_tt share S_ii's and S_tt's)."""
        return {"sii": self.floor_i, "stt": self.floor_t, "sit": self.floor_x,
                "xii": self.floor_i, "xtt": self.floor_t}

    def clusters(self, n: int) -> int:
        c = self.n_clusters or max(1, round(n / self.cluster_rows))
        return max(1, min(c, n))


# a hit is screened by a GEMM this far below its threshold, then judged by its gathered dot
# product (native.pair_dots): spaces.py's one-space searches (a pair at the floor is never
# listed twice nor lost between searches) and count.py's supporters (fp32 GEMM and dot differ
# by ~1e-6 for unit vectors)
MARGIN = 1e-4

COMPACT_SLACK = 1 << 20    # pairs held beyond 2 x n x max_pairs before gather caps them


class Vectors:
    """The sorted vectors a unit reads: arrays or memmaps [N, d] in layout order; ``low``, with
    a low precision, their copies in it by name (the precision's low_copy: bf16's int16 bits on
    disk or device tensors, int8's q8.Copy), which the screen otherwise casts block by block."""

    def __init__(self, img, txt, ximg=None, xtxt=None, low: Optional[dict] = None) -> None:
        self.img, self.txt, self.ximg, self.xtxt = img, txt, ximg, xtxt
        self.low = low

    @property
    def cross(self) -> bool:
        return self.ximg is not None


def _rows(x, a: int, b: int, device: str) -> torch.Tensor:
    return as_tensor(x[a:b], device)


def _whole(x) -> torch.Tensor:
    """x as an fp32 tensor where it lies (a device's copy, or a memmap's pages on the host,
    shared)."""
    return as_tensor(x, x.device if isinstance(x, torch.Tensor) else "cpu")


def _take(x, pos: np.ndarray, device: str) -> Optional[torch.Tensor]:
    return None if x is None else as_tensor(x[pos], device)


def no_pairs() -> dict:
    return {f: np.zeros(0, np.int64 if f in "qj" else np.float32) for f in PAIR_FIELDS}


CACHE_ELEMS = 1 << 18   # values in float64 at once on a CPU (temporaries of ~2 MB, in cache:
                        # the layout's sums and radii, int8's quantization; ~3-6x whole chunks)


def cache_rows(x: torch.Tensor) -> int:
    """Rows of x whose float64 work runs at once: all on a GPU, CACHE_ELEMS values on a CPU
    (row-wise results: the same bits whatever the step)."""
    return max(1, len(x)) if x.is_cuda else max(1, CACHE_ELEMS // max(x.shape[1], 1))
