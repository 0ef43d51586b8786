"""int8's screen kernels in C (screen_int8.c), built and loaded as native.py builds its own
(native.build: cached, VLCURATE_NATIVE=0 turns them off); None where there is none, and the
caller runs torch's GEMMs and compares (the same pairs).

* ``screen_pairs``: the int8 screen's candidate rule (exact integer compares) in one pass over
  a block's sums instead of a bool array per compare.
* ``screen_int8``: an int8 block's two GEMMs (S_ii, S_tt) and screen_pairs' rule in one pass
  with AVX512-VNNI (members packed per block as u8 panels, each query's thresholds shifted
  by 128 x its values' sum): exact integer sums, so the same pairs as torch's GEMMs and
  screen_pairs, without writing and re-reading [nq, nm] int32 sums (1 thread, 451 x 211
  members x 768 dimensions: ~0.46 against ~0.52 ms; 1,024 x 1,024: 4.0 against 4.8 ms).
* ``int_mm`` (amx_int8.c): an int8 GEMM's exact int32 sums with AMX tiles.
* ``count_hits`` (amx_int8.c): the exact noise count's one-space screen over a whole range of
  sorted members in one call, with AMX tiles (exact integer sums against each query's
  threshold for the member's cluster: the same pairs as screen_int8 per cluster)."""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .. import native

SOURCE = Path(__file__).with_name("screen_int8.c")
COUNT_SOURCE = Path(__file__).with_name("amx_int8.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """screen_int8.c, built and loaded; None when turned off or when it cannot be built."""
    return native.build(SOURCE, _declare)


def _declare(lib: ctypes.CDLL) -> None:
    lib.screen_pairs.argtypes = [_P, _P, _I, _I, _P, _P, _P, _P, _P, _I, _P, _P]
    lib.screen_pairs.restype = _I
    lib.screen_int8.argtypes = [_P, _I, _I, _P, _I, _I, _I, _P, _I, _P, _I, _I, _P, _P, _P, _P, _I,
                                _P, _P]
    lib.screen_int8.restype = _I
    lib.vnni_ready.restype = ctypes.c_int


@functools.lru_cache(maxsize=None)
def count_library() -> Optional[ctypes.CDLL]:
    """amx_int8.c, built and loaded; None when turned off or when it cannot be built."""
    return native.build(COUNT_SOURCE, _declare_count)


def _declare_count(lib: ctypes.CDLL) -> None:
    lib.count_hits.argtypes = [_P, _I, _I, _P, _I, _I, _P, _I, _P, _P, _P, _I, _P]
    lib.count_hits.restype = _I
    lib.screen_amx.argtypes = [_P, _I, _I, _P, _I, _I, _I, _P, _I, _P, _I, _I, _P, _P, _P, _P, _I,
                               _P]
    lib.screen_amx.restype = _I
    lib.screen_amx_blocks.argtypes = [_P, _I, _P, _I, _I] + [_P] * 12 + [_I, _P]
    lib.screen_amx_blocks.restype = _I
    lib.int_mm.argtypes = [_P, _I, _P, _I, _I, _P]
    lib.int_mm.restype = _I
    lib.int_argmax.argtypes = [_P, _I, _P, _I, _I, _P]
    lib.int_argmax.restype = _I
    lib.amx_ready.restype = ctypes.c_int


def amx() -> bool:
    """Whether count_hits runs on this CPU (the library, AMX-INT8 and the kernel's leave)."""
    lib = count_library()
    return lib is not None and bool(lib.amx_ready())


def int_mm(a: torch.Tensor, b: torch.Tensor) -> Optional[torch.Tensor]:
    """a [n, d] x b [m, d] int8 -> the exact int32 sums [n, m] with AMX tiles (amx_int8.c); None
    without the library or AMX, on a GPU, or with d not a multiple of 64 (the caller runs
    torch._int_mm: the same integers)."""
    if not USE_AMX or a.device.type != "cpu" or b.device.type != "cpu" or not amx() or \
            a.shape[-1] % 64:
        return None
    lib = count_library()
    x, y = (np.ascontiguousarray(t.numpy(), np.int8) for t in (a, b))
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError("int_mm: operands of different dimensions")
    out = np.empty((len(x), len(y)), np.int32)
    if not out.size:
        return torch.from_numpy(np.zeros(out.shape, np.int32))
    n = lib.int_mm(x.ctypes.data, len(x), y.ctypes.data, len(y), x.shape[1], out.ctypes.data)
    return None if n < 0 else torch.from_numpy(out)


def int_argmax(a: torch.Tensor, b: torch.Tensor) -> Optional[torch.Tensor]:
    """torch.argmax(int_mm(a, b), 1) (int64 [n]: each row's first column of the largest sum)
    with AMX tiles, the sums reduced where they are made, never stored (the layout's
    assignment, 4,096 x 3,906 x 768: ~30 against ~170 ms for int_mm and torch's argmax, one
    core); the rows split over torch's threads (each row's answer is its own). None where
    int_mm would be (the caller forms the sums and their argmax)."""
    if not fused_argmax(a) or b.device.type != "cpu":
        return None
    x, y = (np.ascontiguousarray(t.numpy(), np.int8) for t in (a, b))
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1] or not len(y):
        raise ValueError("int_argmax: operands of different dimensions, or no columns")
    out = np.zeros(len(x), np.int64)
    lib, d = count_library(), x.shape[1]
    parts = max(1, min(torch.get_num_threads(), len(x) // 4096))
    cuts = np.linspace(0, len(x), parts + 1).astype(np.int64)

    def part(i: int) -> int:
        a0, a1 = cuts[i], cuts[i + 1]
        return lib.int_argmax(x[a0:].ctypes.data, a1 - a0, y.ctypes.data, len(y), d,
                              out[a0:].ctypes.data) if a1 > a0 else 0
    with concurrent.futures.ThreadPoolExecutor(len(cuts) - 1) as pool:   # ctypes frees the GIL
        if min(pool.map(part, range(len(cuts) - 1))) < 0:
            return None
    return torch.from_numpy(out)


def fused_argmax(a: torch.Tensor) -> bool:
    """Whether int_argmax runs for rows a (AMX here, host rows of a multiple of 64 bytes)."""
    return USE_AMX and a.device.type == "cpu" and a.shape[-1] % 64 == 0 and amx()


def count_hits(q: np.ndarray, members: np.ndarray, a: int, b: int, bounds: np.ndarray,
               c0: int, lim: np.ndarray, cap: int) -> Optional[tuple]:
    """(query index, member row, the row it stopped at) of the pairs of queries q [nq, d] x
    members[a:b] (int8 arrays; members: every sorted row, clusters ``bounds``) whose integer
    sum exceeds lim[cluster - c0, query] (int32 [clusters, nq rounded up to 32]); stops before
    a 32-member group that might not fit in ``cap`` pairs (at least 32 x lim's width). None
    without the library or AMX, or with a dimension that is not a multiple of 64 (the caller
    screens per cluster)."""
    lib = count_library()
    if lib is None:
        return None
    q = np.ascontiguousarray(q, np.int8)
    lim = np.ascontiguousarray(lim, np.int32)
    bounds = np.ascontiguousarray(bounds, np.int64)
    nq, d = q.shape
    width = -(-nq // 32) * 32
    if members.dtype != np.int8 or not members.flags.c_contiguous or members.shape[1] != d or \
            lim.shape[1] != width or cap < 32 * width or not 0 <= a <= b <= len(members) or \
            not (0 <= c0 and c0 + len(lim) < len(bounds) and bounds[c0] <= a and
                 bounds[c0 + len(lim)] >= b):
        raise ValueError("count_hits: queries, members, thresholds or room of different shapes")
    out_q, out_j = np.empty(cap, np.int64), np.empty(cap, np.int64)
    stop = np.zeros(1, np.int64)
    n = lib.count_hits(q.ctypes.data, nq, d, members.ctypes.data, a, b, bounds.ctypes.data,
                       c0, lim.ctypes.data, out_q.ctypes.data, out_j.ctypes.data, cap,
                       stop.ctypes.data)
    return None if n < 0 else (out_q[:n], out_j[:n], int(stop[0]))


def screen_pairs(di: np.ndarray, dt: np.ndarray, lim_i: list, lim_t: list,
                 extra: Optional[np.ndarray], first: int) -> Optional[np.ndarray]:
    """first + the flat indices of a block's pairs that pass the rule (q8.rule's, on int32 sums
    di and dt [nq, nm] against each row's [floor, tau] of img and txt: int32 [nq, 1]; ``extra``
    a bool mask OR-ed in, or None), ascending; None without the native library."""
    lib = library()
    if lib is None:
        return None
    di, dt = np.ascontiguousarray(di, np.int32), np.ascontiguousarray(dt, np.int32)
    lims = [np.ascontiguousarray(t, np.int32) for t in (*lim_i, *lim_t)]
    extra = None if extra is None else np.ascontiguousarray(extra, np.uint8)
    nq, nm = di.shape
    if dt.shape != di.shape or any(t.shape != (nq, 1) for t in lims) or (
            extra is not None and extra.shape != di.shape):
        raise ValueError("screen_pairs: sums, thresholds and mask of different shapes")
    out, keep = np.empty(nq * nm, np.int64), np.empty(max(nm, 1), np.uint8)
    n = lib.screen_pairs(di.ctypes.data, dt.ctypes.data, nq, nm, *(t.ctypes.data for t in lims),
                         None if extra is None else extra.ctypes.data, first,
                         out.ctypes.data, keep.ctypes.data)
    return out[:n]


def vnni() -> bool:
    """Whether screen_int8 runs on this CPU (the library, and AVX512-VNNI)."""
    lib = library()
    return lib is not None and bool(lib.vnni_ready())


def screen_int8(qi: torch.Tensor, mi: torch.Tensor, qt: Optional[torch.Tensor],
                mt: Optional[torch.Tensor], lim_i: list, lim_t: Optional[list], first: int
                ) -> Optional[np.ndarray]:
    """first + the flat indices (ascending) of the pairs of queries qi, qt [nq, d] x members
    mi, mt [nm, d] (int8 tensors) that pass screen_pairs' rule against each row's [floor, tau]
    thresholds (int32 [nq, 1]) of img and txt: the two GEMMs and the rule fused in C with AMX
    tiles where they run and dimensions are multiples of 64 (amx_int8.c), else AVX512-VNNI; no
    int32 sums written. qt None: one similarity, the pairs above lim_i's
    floor alone (q8.hits). None without the library, on a GPU, on a CPU without AVX512-VNNI
    or with a dimension that is not a multiple of 4 (the caller multiplies)."""
    lib = library()
    ops = (qi, mi) if qt is None else (qi, mi, qt, mt)
    if lib is None or any(x.device.type != "cpu" for x in ops):
        return None
    a = [np.ascontiguousarray(x.numpy(), np.int8) for x in ops]
    lims = [np.ascontiguousarray(t, np.int32) for t in (lim_i[:1] if qt is None else
                                                        (*lim_i, *lim_t))]
    (nq, di), nm = a[0].shape, len(a[1])
    dt = 0 if qt is None else a[2].shape[1]
    if a[1].shape != (nm, di) or (qt is not None and (a[2].shape[0] != nq or a[3].shape != (
            nm, dt))) or any(t.shape != (nq, 1) for t in lims):
        raise ValueError("screen_int8: queries, members and thresholds of different shapes")
    out = np.empty(max(nq * nm, 1), np.int64)
    txt = (None, 0, 0, None, 0) if qt is None else (a[2].ctypes.data, dt, dt, a[3].ctypes.data, dt)
    lims += [lims[0]] * (4 - len(lims))                  # unread with one similarity
    args = (a[0].ctypes.data, di, di, *txt[:3], nq, a[1].ctypes.data, di, *txt[3:], nm,
            *(t.ctypes.data for t in lims), first, out.ctypes.data)
    amx_ = count_library()
    n = -1 if amx_ is None or not USE_AMX else amx_.screen_amx(*args)     # AMX where it runs
    if n < 0:
        panels = -(-nm // 16)
        scratch = np.empty(16 * panels * (di + dt) + 16 * nq + 2 * nq * panels + 64, np.uint8)
        n = lib.screen_int8(*args, scratch.ctypes.data)
    return None if n < 0 else out[:n]


def screen_blocks(qi: torch.Tensor, qt: torch.Tensor, spans: list, members: list,
                  lim_i: list, lim_t: list, firsts: np.ndarray,
                  own: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """screen_int8 of a stack's blocks with AMX, in one call (no Python per block): block u is
    query rows spans[u] of qi, qt [nq, d] against members[u] = (img, txt) int8 [nm, d], with
    the thresholds of lim_i, lim_t ([floor, tau], int32 [rows, 1], the spans' rows one span
    after the other) and flat indices from firsts[u]; the blocks' pairs one after the other,
    each block's ascending, as screen_int8 block by block lists them, without the flat indices
    ``own`` (screen._without's, left out as they are listed when ascending). None where screen_amx
    would not run (or a layout it does not read in place: the caller screens block by
    block)."""
    lib = count_library()
    ops = [qi, qt, *(x for m in members for x in m)]
    if lib is None or not USE_AMX or not members or any(
            x.device.type != "cpu" or x.dtype != torch.int8 or x.dim() != 2 or
            x.stride(1) != 1 or x.stride(0) != x.shape[1] for x in ops):
        return None
    di, dt = qi.shape[1], qt.shape[1]
    if qt.shape[0] != qi.shape[0] or any(mi.shape[1] != di or mt.shape[1] != dt or
                                        len(mi) != len(mt) for mi, mt in members):
        raise ValueError("screen_blocks: queries and members of different shapes")
    q0, q1 = (np.array([s[h] for s in spans], np.int64) for h in (0, 1))
    nm = np.array([len(mi) for mi, _ in members], np.int64)
    lim0 = np.cumsum(np.r_[0, q1 - q0])
    lims = [np.ascontiguousarray(t, np.int32) for t in (*lim_i, *lim_t)]
    if q0.min() < 0 or q1.max() > len(qi) or (q1 < q0).any() or \
            any(t.shape != (lim0[-1], 1) for t in lims):
        raise ValueError("screen_blocks: spans or thresholds out of the queries' rows")
    ptr = [np.array([m[h].data_ptr() for m in members], np.int64) for h in (0, 1)]
    firsts = np.ascontiguousarray(firsts, np.int64)
    own = np.ascontiguousarray(np.zeros(0, np.int64) if own is None else own, np.int64)
    if len(own) > 1 and not (own[1:] > own[:-1]).all():
        own = own[:0]                       # not ascending: the caller leaves them out
    out = np.empty(max(int(((q1 - q0) * nm).sum()), 1), np.int64)
    n = lib.screen_amx_blocks(qi.data_ptr(), di, qt.data_ptr(), dt, len(members),
                              *(x.ctypes.data for x in (q0, q1, *ptr, nm, lim0, firsts, *lims)),
                              own.ctypes.data, len(own), out.ctypes.data)
    return None if n < 0 else out[:n]


USE_AMX = True       # screen_int8 tries amx_int8.c's screen_amx first (the same pairs)
