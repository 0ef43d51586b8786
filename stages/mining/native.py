"""The neighbour pass's per-pair loops in C (native.c), built on first use with the system's C
compiler and loaded with ctypes; torch and NumPy where there is none (or on a GPU).

Both ways give the same bytes, by construction (tests/stages/mining/test_native.py):

* ``pair_dots``: the exact fp32 similarities of listed pairs (the re-score of a low-precision
  screen, the one-space pairs' similarities). The sum's order is fixed (native.c: 16 lanes,
  then a tree) and ``_lane_dots`` repeats it in torch elementwise ops, which round the same on
  any device. On a CPU the C loop reads the rows in place, ~2-3x faster than torch's gathers
  (1 thread, 384 dimensions: ~0.13 against ~0.3-0.45 us a pair).
* ``top_columns``: routing's probe best clusters of each query (equal scores by the lower
  cluster: the same set on any device, hpm.top_columns in torch), and the certificate's
  bound over the others (the k-th largest is bounded below by the k-th largest maximum of
  16-value groups: only the ~probe groups that reach it are read again). ``route_columns``
  forms int8 routing's scores from the GEMM's integer sums row by row, as torch would, and
  selects the same way: no [n, C] float copy (1 thread, 1,073 x 3,906: ~6 ms against ~25
  for torch's scores and NaN scan plus the former C selection, ~66 for torch's top-k).
* ``block_findings``: engine.units.Findings.add's selection of a block's candidate pairs (the
  floors and the per-row cap, Alg. 1's positives, their support and each row's best k) in one
  pass over them, instead of ~20 torch operations over every candidate.
* ``dense_read``: a dense block's candidates read off its fp32 GEMMs (screen.dense_pairs): the
  pairs' rows, columns and similarities in one pass, instead of ~8 torch and NumPy calls.
* ``add_rows``: the layout's member sums (float64, each element's additions in row order, as
  torch's index_add_ makes them), one loop instead of a few hundred torch calls per chunk (on a
  loaded machine each 2-thread call could stall for milliseconds).
* ``row_best``: the merged top-k of a chunk's targets (engine.topk.Best.dense): a counting sort by
  row, then a sort within each row, instead of sorting every entry; ``stable_order``: the
  (query, cluster) entries by cluster (engine.passes.by_cluster), a counting sort.

The int8 screen's kernels are the int8 package's (int8/kernels.py, int8/screen_int8.c),
built the same way (``build``).

The build is cached under ``$VLCURATE_NATIVE_DIR`` (default ``~/.cache/vlcurate/native``, a
temporary directory where that cannot be written), keyed by the source and flags; a cluster's
nodes each build their own (deploy/Dockerfile has a compiler). ``VLCURATE_NATIVE=0`` turns it
off; a failed build warns once and the pass runs on without it."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from . import hpm

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
LANES = 16                # native.c's
CHUNK = 4096              # pairs summed at once in torch on a CPU (bounded memory); on a GPU
GPU_CHUNK = 1 << 16      # more at once: each of _lane_dots' ~30 steps is a kernel launch
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.lru_cache(maxsize=None)
def library() -> Optional[ctypes.CDLL]:
    """native.c, built and loaded; None when turned off or when it cannot be built."""
    return build(SOURCE, _declare)


def build(source: Path, declare) -> Optional[ctypes.CDLL]:
    """The C file ``source`` built (cached, ``_built``) and loaded, its functions' types set by
    ``declare(lib)``; None when VLCURATE_NATIVE=0 or when it cannot be built (a warning)."""
    if os.environ.get("VLCURATE_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_built(source)))
    except (OSError, subprocess.SubprocessError) as e:
        said = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()[-500:]
        log.warning("vlcurate: native mining kernels unavailable (%s: %s%s); using torch (same "
                    "results, slower)", source.name, e, f": {said}" if said else "")
        return None
    declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    lib.pair_dots.argtypes = [_P, _I, _P, _P, _I, _P, _I, _I, _P]
    lib.top_columns.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, _P]
    lib.top_columns.restype = _I
    lib.route_columns.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, _P, _P, _P, _P]
    lib.route_columns.restype = _I
    lib.stable_order.argtypes = [_P, _I, _I, _P, _P]
    lib.row_best.argtypes = [_P, _P, _P, _I, _I, _I, _P, _P, _P, _P]
    lib.row_best.restype = _I
    lib.at_or_above_kth.argtypes = [_P, _P, _I, _I, _P, _P]
    _F = ctypes.c_float
    lib.block_findings.argtypes = [_P, _I, _I, _P, _P, _I, _F, _F, _F, _I, _I, _P, _P, _P, _P,
                                   _P, _P, _P, _P]
    lib.block_findings.restype = _I
    lib.add_rows.argtypes = [_P, _I, _P, _I, _I, _P]
    lib.dense_read.argtypes = [_P, _I, _I, _I, _I, _I, _I, _P, _P, _I, _P, _P]
    lib.dense_read.restype = _I


def _built(source: Path) -> Path:
    """The shared library's path, compiled there first if it is not cached yet (written to a
    temporary name and renamed: processes building at once each get a whole file)."""
    cc = shlex.split(os.environ.get("CC") or "cc")       # e.g. "ccache gcc"
    key = hashlib.sha256(source.read_bytes() + " ".join([*cc, *FLAGS]).encode()).hexdigest()
    out = _cache_dir() / f"mining-{source.stem}-{key[:16]}.so"
    if not out.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            subprocess.run([*cc, *FLAGS, "-o", tmp, str(source)], check=True, timeout=300,
                           capture_output=True)
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def _cache_dir() -> Path:
    for d in (os.environ.get("VLCURATE_NATIVE_DIR"),
              Path.home() / ".cache" / "vlcurate" / "native",
              Path(tempfile.gettempdir()) / f"vlcurate-native-{os.getuid()}"):
        if d is not None:
            try:
                Path(d).mkdir(parents=True, exist_ok=True)
                if os.access(d, os.W_OK):
                    return Path(d)
            except OSError:
                continue
    raise OSError("no writable directory for the native build (set VLCURATE_NATIVE_DIR)")


def pair_dots(a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor,
              device) -> torch.Tensor:
    """fp32 <a[ia[p]], b[ib[p]]> for every p, on ``device`` (a and b: [n, d] fp32, where they
    lie: a host memmap's rows are read in place, or gathered to the device)."""
    lib = library()
    if lib is not None and _host_rows(a) and _host_rows(b) and torch.device(device).type == "cpu":
        ia, ib = (x.to("cpu", torch.int64).contiguous() for x in (ia, ib))
        _check_rows(a, ia, b, ib)                  # C reads where the indices say: check them
        out = torch.empty(len(ia), dtype=torch.float32)
        lib.pair_dots(a.data_ptr(), a.stride(0), ia.data_ptr(), b.data_ptr(), b.stride(0),
                      ib.data_ptr(), len(ia), a.shape[1], out.data_ptr())
        return out
    parts = [torch.zeros(0, device=device)]
    step = CHUNK if torch.device(device).type == "cpu" else GPU_CHUNK
    for i in range(0, len(ia), step):
        parts.append(_lane_dots(_gather(a, ia[i:i + step], device),
                                _gather(b, ib[i:i + step], device)))
    return torch.cat(parts)


def _check_rows(a: torch.Tensor, ia: torch.Tensor, b: torch.Tensor, ib: torch.Tensor) -> None:
    if a.shape[1] != b.shape[1] or len(ia) != len(ib):
        raise ValueError(f"pair_dots: rows of {a.shape[1]} and {b.shape[1]} dimensions, "
                         f"{len(ia)} and {len(ib)} indices")
    for x, i in ((a, ia), (b, ib)):
        i = i.numpy()       # host indices: NumPy's min/max (torch's, 2 threads, loaded: ~3 ms)
        if len(i) and (int(i.min()) < 0 or int(i.max()) >= len(x)):
            raise IndexError(f"pair_dots: row indices outside 0..{len(x) - 1}")


def _host_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1


def _gather(x: torch.Tensor, rows: torch.Tensor, device) -> torch.Tensor:
    """Rows of x, on ``device`` (x may be a host copy of memory-mapped vectors: a GPU pass
    whose vectors do not fit on the device gathers the rows on the host)."""
    return x.index_select(0, rows.to(x.device)).to(device)


def _lane_dots(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Row-wise <x, y> in native.c's order: the products (in place in x), lane j's sum over
    dimensions j, j + 16, ... (a zero-padded tail adds +0, which changes no sum), then the
    lanes as a tree."""
    p = x.mul_(y)
    pad = -p.shape[1] % LANES
    p = torch.nn.functional.pad(p, (0, pad)) if pad else p
    p = p.view(len(p), -1, LANES)
    acc = torch.zeros(len(p), LANES, device=p.device)
    for k in range(p.shape[1]):
        acc += p[:, k]
    w = LANES // 2
    while w:
        acc = acc[:, :w] + acc[:, w:2 * w]
        w //= 2
    return acc[:, 0]


def top_columns(m: torch.Tensor, k: int, reach: Optional[torch.Tensor] = None) -> tuple:
    """(each row's k largest of m [n, c] as ascending columns, equal values by the lower
    column: int64 NumPy [n, k]; with ``reach`` [c], the largest m + reach over each row's other
    columns, -inf where none: float32 NumPy [n], else None). k <= c. A NaN score (a NaN
    vector) goes to torch's path, where topk ranks it highest, as before (C finds it and
    stops)."""
    if k > m.shape[1]:
        raise ValueError(f"top_columns: {k} of {m.shape[1]} columns")
    lib = library()
    if lib is not None and k > 0 and m.device.type == "cpu" and m.dtype == torch.float32:
        got = _selected(lib.top_columns, m.contiguous(), m.shape, k, reach, ())
        if got is not None:
            return got
    return _torch_top(m, k, reach)


def route_columns(sums: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                  own: Optional[np.ndarray], k: int, reach: Optional[torch.Tensor]
                  ) -> Optional[tuple]:
    """``top_columns`` of routing's int8 scores fp32(sums) * scale[:, None] + bias (int32
    [n, c], fp32 [n] and [c]; each step rounded, as torch does it) with +inf at each row's own
    column own [n] (None: no own column), formed row by row in C (no [n, c] float copy); None
    without the library, on a GPU, or with a NaN score (the caller forms them in torch)."""
    lib = library()
    if lib is None or sums.device.type != "cpu" or not 0 < k <= sums.shape[1]:
        return None
    if own is not None:
        own = np.ascontiguousarray(own, np.int64)
        if own.shape != (len(sums),) or (len(own) and not 0 <= own.min() <= own.max()
                                         < sums.shape[1]):
            raise IndexError("route_columns: own columns out of range")
    args = (_f32(scale), _f32(bias))
    if args[0].shape != (len(sums),) or args[1].shape != (sums.shape[1],):
        raise ValueError("route_columns: scale or bias of the wrong shape")
    return _selected(lib.route_columns, sums.to(torch.int32).contiguous(), sums.shape, k, reach,
                     (*(a.data_ptr() for a in args), None if own is None else own.ctypes.data),
                     floats=3)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous()


def _selected(fn, m: torch.Tensor, shape, k: int, reach, before: tuple, floats: int = 2):
    """Run C's top_columns or route_columns over m (args ``before`` between the shape and k);
    None when it met a NaN."""
    (n, c), ahead = shape, None if reach is None else _f32(reach)
    if ahead is not None and ahead.shape != (c,):
        raise ValueError("top_columns: reach of the wrong shape")
    top, out = np.empty((n, k), np.int64), np.empty(n, np.float32)
    fs, is_ = np.empty(floats * c, np.float32), np.empty(c + c // LANES, np.int64)
    stop = fn(m.data_ptr(), n, c, *before, k, None if ahead is None else ahead.data_ptr(),
              top.ctypes.data, out.ctypes.data, fs.ctypes.data, is_.ctypes.data)
    return None if stop >= 0 else (top, None if reach is None else out)


def _torch_top(m: torch.Tensor, k: int, reach: Optional[torch.Tensor]) -> tuple:
    cols = hpm.top_columns(m, k)
    if reach is None:
        return cols.cpu().numpy(), None
    rest = (m + reach.unsqueeze(0)).scatter_(1, cols, -math.inf)
    out = rest.max(1).values if m.shape[1] > k else torch.full((len(m),), -math.inf)
    return cols.cpu().numpy(), out.cpu().numpy().astype(np.float32)


def stable_order(key: np.ndarray, n: int) -> Optional[np.ndarray]:
    """The order of key's entries (ints in 0..n-1) by key, stably: a counting sort in C (~1/10
    of NumPy's radix argsort for 2M 16-bit keys); None without the library."""
    lib = library()
    if lib is None:
        return None
    key = _keys(key, n)
    order, count = np.empty(len(key), np.int64), np.empty(n + 1, np.int64)
    lib.stable_order(key.ctypes.data, len(key), n, count.ctypes.data, order.ctypes.data)
    return order


_kept = threading.local()


@contextlib.contextmanager
def scratch_kept(store: Optional[dict] = None):
    """Within it (a chunk: passes.mine_routed), row_best's and block_findings' scratch arrays
    are kept from call to call in this thread, in ``store`` (kept by the caller from chunk to
    chunk: the layout's, so they go with it) or for the outermost block alone: at ~10M entries
    each is a fresh mmap (glibc maps anything over 32 MB), whose huge pages the kernel zeroed
    anew every call (~8% of a 1M pass). Speed only: no larger peak (they lived through the call
    before), held between chunks."""
    outer = getattr(_kept, "arrays", None)
    _kept.arrays = outer if outer is not None else {} if store is None else store
    try:
        yield
    finally:
        if outer is None:
            _kept.arrays = None


def scratch(name: str, n: int, dtype) -> np.ndarray:
    """n elements of scratch (contents undefined): kept ones within scratch_kept (the same
    memory at the next call by that name in this thread), else new."""
    arrays = getattr(_kept, "arrays", None)
    if arrays is None:
        return np.empty(n, dtype)
    got = arrays.get(name)
    if got is None or len(got) < n:
        got = arrays[name] = np.empty(max(n, 0 if got is None else len(got) * 5 // 4), dtype)
    return got[:n]


def _keys(key, n: int) -> np.ndarray:
    key = np.ascontiguousarray(key, np.int64)
    if len(key) and not 0 <= key.min() <= key.max() < n:
        raise IndexError(f"keys out of 0..{n - 1}")
    return key


def row_best(r: torch.Tensor, j: torch.Tensor, s: torch.Tensor, n: int, k: int
             ) -> Optional[tuple]:
    """Each of n rows' k best entries (row r, global row j, score s; (r, j) distinct): best
    score first, equal scores by ascending j, as (idx [n, k] -1 padded, score [n, k] 0 padded)
    tensors: a counting sort by row and a sort within each row in C, instead of sorting every
    entry (engine.topk.Best.dense's torch path, the same result). None without the library, on a
    GPU, or with a NaN score."""
    lib = library()
    if lib is None or r.device.type != "cpu":
        return None
    r, j = _keys(r.numpy(), n), np.ascontiguousarray(j.numpy(), np.int64)
    s = np.ascontiguousarray(s.numpy(), np.float32)
    if not len(r) == len(j) == len(s):
        raise ValueError("row_best: entries of different lengths")
    idx, score = np.empty((n, k), np.int64), np.empty((n, k), np.float32)
    count = scratch("count", n + 1, np.int64)
    by_row = scratch("by_row", 2 * len(r), np.int64)    # (score, j): 16 bytes an entry
    stop = lib.row_best(r.ctypes.data, j.ctypes.data, s.ctypes.data, len(r), n, k,
                        idx.ctypes.data, score.ctypes.data, count.ctypes.data, by_row.ctypes.data)
    return None if stop >= 0 else (torch.from_numpy(idx), torch.from_numpy(score))


def at_or_above_kth(r: torch.Tensor, v: torch.Tensor, k: int) -> Optional[torch.Tensor]:
    """topk.at_or_above_kth's mask (v at least the k-th largest of its run of equal r, NaN as
    -inf; every entry of a run of at most k) by a quickselect per run in C, the same mask as
    torch's dense top-k; None without the library or on a GPU."""
    lib = library()
    if lib is None or r.device.type != "cpu" or k < 1:
        return None
    r = np.ascontiguousarray(r.numpy(), np.int64)
    v = np.ascontiguousarray(v.numpy(), np.float32)
    if len(r) != len(v):
        raise ValueError("at_or_above_kth: rows and values of different lengths")
    keep, scratch = np.empty(len(r), np.bool_), np.empty(max(len(r), 1), np.float32)
    lib.at_or_above_kth(r.ctypes.data, v.ctypes.data, len(r), k, keep.ctypes.data,
                        scratch.ctypes.data)
    return torch.from_numpy(keep)


def block_findings(r: torch.Tensor, val: dict, floors: dict, p, support: torch.Tensor,
                   cut: np.ndarray) -> Optional[tuple]:
    """Findings.add's selection in C (native.c): of the block's candidate pairs (rows r, r
    ascending; val: SIMS' similarities present, fp32), the indices of those kept above the
    floors (with p.max_pairs, cut to each row's best max_pairs by their best similarity) and
    of the positives among each row's best p.k, with their scores; support and cut counted in
    place. The same pairs in the same order as the torch path. None without the library, on a
    GPU, or with r not ascending or values not fp32 (the caller runs torch's)."""
    lib = library()
    if lib is None or not _host_findings(r, val, p, support, cut):
        return None
    from .engine.core import SIMS
    r = r.contiguous()
    sims = [val[f].contiguous() if f in val else None for f in SIMS]
    if any(x is not None and len(x) != len(r) for x in sims) or sims[0] is None \
            or sims[1] is None:
        raise ValueError("block_findings: similarities of other lengths than the rows")
    mp = 0 if p.max_pairs is None else p.max_pairs
    ptrs = (ctypes.c_void_p * 5)(*(None if x is None else x.data_ptr() for x in sims))
    fl = np.array([floors[f] for f in SIMS], np.float32)
    e = len(r)
    kept, top = scratch("kept", e, np.int64), scratch("top", e, np.int64)
    v, spare, held = (scratch(x, e, np.float32) for x in ("v", "spare", "held"))
    out = np.zeros(2, np.int64)
    dup = math.nan if p.dup is None else p.dup
    stop = lib.block_findings(r.data_ptr(), e, len(support), ptrs, fl.ctypes.data, mp, p.tau_i,
                              p.tau_t, dup, p.dup is not None, p.k, support.data_ptr(),
                              cut.ctypes.data, kept.ctypes.data, top.ctypes.data, v.ctypes.data,
                              spare.ctypes.data, held.ctypes.data, out.ctypes.data)
    if stop >= 0:
        if e and (int(r.min()) < 0 or int(r.max()) >= len(support)):
            raise IndexError(f"block_findings: rows outside 0..{len(support) - 1}")
        return None
    nk, nt = (int(x) for x in out)
    return tuple(torch.from_numpy(x[:m].copy()) for x, m in ((kept, nk), (top, nt), (v, nt)))


def _host_findings(r: torch.Tensor, val: dict, p, support: torch.Tensor, cut: np.ndarray) -> bool:
    """Whether block_findings' C loop reads these as they are: host int64 rows, fp32 values,
    int64 counts in place, k and max_pairs at least 1."""
    return r.device.type == "cpu" and r.dtype == torch.int64 and p.k >= 1 \
        and (p.max_pairs is None or p.max_pairs >= 1) and support.dtype == torch.int64 \
        and support.is_contiguous() and cut.dtype == np.int64 and cut.flags.c_contiguous \
        and all(v.dtype == torch.float32 and v.device.type == "cpu" for v in val.values())


def add_rows(x: torch.Tensor, lab: torch.Tensor, sums: torch.Tensor) -> bool:
    """sums.index_add_(0, lab, x.double()) in C, row by row in order (the same sums); False
    (nothing added) without the library, off the host, or with other dtypes or layouts."""
    lib = library()
    if lib is None or any(t.device.type != "cpu" for t in (x, lab, sums)) or \
            x.dtype != torch.float32 or lab.dtype != torch.int64 or sums.dtype != torch.float64 \
            or x.dim() != 2 or x.stride(1) != 1 or not lab.is_contiguous() or \
            not sums.is_contiguous() or sums.dim() != 2 or sums.shape[1] != x.shape[1] or \
            len(lab) != len(x):
        return False
    if len(lab) and (int(lab.min()) < 0 or int(lab.max()) >= len(sums)):
        raise IndexError(f"add_rows: rows outside 0..{len(sums) - 1}")
    lib.add_rows(x.data_ptr(), x.stride(0), lab.data_ptr(), len(x), x.shape[1], sums.data_ptr())
    return True


def dense_read(sims: dict, flat: torch.Tensor, at: int, a: int, first: int, got: dict,
               rows: torch.Tensor, cols: torch.Tensor) -> bool:
    """screen.dense_pairs' reading of one block in C: for the flat indices ``flat`` (ascending,
    from ``at`` on, within the block) of its [nq, nm] similarities ``sims`` (fp32, row-major),
    the pairs' rows (a + the block's row), columns (first + its column) and values into
    ``rows``, ``cols`` and ``got`` (views as long as flat). False (nothing written) without the
    library, off the host, or with other dtypes or layouts."""
    lib = library()
    xs = list(sims.values())
    outs = [got[s] for s in sims]
    if lib is None or not xs or any(
            t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
            for t in (*xs, *outs)) or any(x.shape != xs[0].shape or x.dim() != 2 for x in xs) \
            or any(t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu"
                   for t in (flat, rows, cols)) or \
            any(len(t) != len(flat) for t in (*outs, rows, cols)):
        return False
    (nq, nm), P = xs[0].shape, ctypes.c_void_p * len(xs)
    bad = lib.dense_read(flat.data_ptr(), len(flat), at, nq, nm, a, first,
                         P(*(x.data_ptr() for x in xs)), P(*(o.data_ptr() for o in outs)),
                         len(xs), rows.data_ptr(), cols.data_ptr())
    if bad >= 0:
        raise IndexError(f"dense_read: flat index {int(flat[bad])} outside the block from {at} "
                         f"({nq} x {nm}) or not ascending")
    return True
