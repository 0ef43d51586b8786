"""hpm.engine.precision int8 as a precision object (engine/precision.py): int8 GEMMs for the layout's
assignment, routing and both screens, a per-cluster int8 copy of the sorted vectors, and the
pairs re-scored in fp32 (q8.py proves the screen a superset)."""
from __future__ import annotations

import os

import numpy as np
import torch

from ..engine import screen
from ..engine.core import _rows
from ..engine.precision import Precision
from . import kernels, q8, routing

# int8 falls back to fp32 at screen.DENSE_SHARE x this: on 1 thread a re-scored pair cost
# ~0.42 us (torch's gathers) and the fallback ~27 ns per pair of the block (its fp32 GEMMs and
# pass, ~4x int8's screen), so the break-even was ~1/16 of the block's pairs (interleaved,
# 32,768 targets: ~4% faster than at 1/64). The C re-score (~0.13 us a pair) moves it towards
# ~1/5, but 8 and 16 measured no faster: no block of the 1M synthetic set falls back at all.
DENSE_GAIN = 4


class Int8(Precision):
    name = "int8"
    dtype = coarse_dtype = torch.bfloat16     # a two-level layout's coarse centroids
    rescores = True
    space_copies = True
    auto_rank = 1                             # auto's choice where the device has int8 GEMMs

    def native(self, device: str) -> bool:
        """A GPU with int8 tensor cores (compute capability 7.2 or 7.5 on: Xavier, Turing and
        later), a CPU with AVX512-VNNI or AMX (its flags, or kernels.vnni: the fused screen)."""
        if device.startswith("cuda"):
            return torch.cuda.get_device_capability(torch.device(device)) >= (7, 2)
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((x for x in f if x.startswith("flags")), "").split()
        except OSError:
            flags = []
        return bool({"avx512_vnni", "amx_int8"} & set(flags)) or kernels.vnni()

    def assigned(self, x):
        return routing.assigned(x)

    def nearest(self, x, cent):
        return routing.nearest(x, cent)

    def routing_scores(self, lay, x):
        sums, scale, bias, err = routing._int8_routing(lay, x)
        return routing._scores(sums, scale, bias), err

    def route_top(self, lay, x, probe, own, reach):
        return routing.int8_top(lay, x, probe, own, reach)

    def space_rows(self, x):
        return q8.rows(x)

    def space_top(self, lay, x, probe, rows=None):
        return routing.int8_top(lay, x, probe, q=rows)[0][0]

    def queries(self, x: dict) -> dict:
        return {f: None if v is None else q8.rows(v) for f, v in x.items()}

    def screen(self, q, blocks, floors, tau_i, tau_t, own, members):
        """Each block's integer sums against its rows' thresholds (exact integers: no second
        pass), the candidates re-scored in fp32, unless dense (then read off fp32 GEMMs of the
        blocks holding a candidate: screen.dense_pairs)."""
        at = screen.offsets(blocks)
        flat = q8.candidates(q.low, blocks, screen.PAIRS, floors, tau_i, tau_t, at, own)
        flat = screen._without(flat.to(own.device), own)
        if len(flat) <= screen.DENSE_SHARE * DENSE_GAIN * at[-1]:
            return screen.rescore_flat(q, blocks, flat, members)
        return screen.dense_pairs(q, blocks, flat, members)

    def space_screen(self, x, rows, floor):
        return (q8.rows(x) if rows is None else rows), floor, q8.hits

    def space_block(self, copy, members, rows, cluster, x, device):
        """The stored copy's rows (its cluster's scale and bounds), else quantized as read."""
        if copy is not None:
            return copy.block(rows, cluster, device)
        return q8.block(_rows(members, rows.start, rows.stop, device))

    def space_count(self, copy, x, bounds, floor):
        """On a CPU with AMX, whole ranges at once (kernels.count_hits): the stored copy's rows
        against each query's threshold for their cluster (q8.table: the same as space_block
        and hits per cluster), ~6x the rate of screen_int8's VNNI and no Python per cluster."""
        if copy is None or x.values.device.type != "cpu" or x.shape[1] % 64 or \
                isinstance(copy.values, torch.Tensor) or not kernels.amx():
            return None
        values = copy.values

        def screen(rows, skip, a, b, cap):
            c0, c1 = np.searchsorted(bounds, [a, b - 1], side="right") - 1
            q = x.index_select(0, torch.as_tensor(rows))
            width = -(-len(rows) // 32) * 32
            lim = q8.table(q, copy.stats[c0:c1 + 1], floor, skip[:, c0:c1 + 1], width)
            return kernels.count_hits(q.values.numpy(), values, a, b, bounds, int(c0), lim,
                                      cap)
        return screen

    def low_copy(self, x, lay):
        """A q8.Copy: per-cluster scales and bounds."""
        from ..engine.persist import _cluster_chunks
        parts = [q8.cluster_copy(x[a:b], lay.cluster_of(np.arange(a, b)), lay.n_clusters)
                 for a, b in _cluster_chunks(lay, 65536)]
        return q8.Copy(np.concatenate([v for v, _ in parts] or
                                      [np.zeros((0, x.shape[1]), np.int8)]),
                       sum(st for _, st in parts) if parts else np.zeros((lay.n_clusters, 3)))

    def copy_writer(self, dir_, name, lay):
        return _CopyWriter(os.path.join(dir_, f"{name}.{self.name}"), lay)

    def load_copy(self, dir_, name, n, d):
        from ..engine.kernels import mapped
        path = os.path.join(dir_, f"{name}.{self.name}")
        if not (os.path.exists(path) and n):
            return None
        return q8.Copy(mapped(path, np.int8, (n, d)), np.load(f"{path}.npy"))


class _CopyWriter:
    """``<name>.int8``: the values, whole clusters at a time; on close, each cluster's scale
    and bounds in ``<name>.int8.npy``."""

    def __init__(self, path: str, lay) -> None:
        self.path, self.lay = path, lay
        self.fh = open(path, "wb")
        self.stats = np.zeros((lay.n_clusters, 3))

    def write(self, block: np.ndarray, a: int, b: int) -> None:
        lay = self.lay
        v, s = q8.cluster_copy(block, lay.cluster_of(np.arange(a, b)), lay.n_clusters)
        self.fh.write(v.tobytes())
        self.stats += s                         # each cluster in one chunk: zeros elsewhere

    def close(self) -> None:
        self.fh.close()
        np.save(f"{self.path}.npy", self.stats)
