"""hpm.engine.precision as an object: what the pass computes in fp32, bf16 or int8.

The engine asks its ``Precision`` (``get(p.precision)``) for every step that depends on it and
never compares precision names:

* the layout's GEMMs (``assigned``, ``nearest``: k-means and assignment; ``coarse_dtype``: a
  two-level layout's coarse centroids), which only decide where rows sit;
* routing (``routing_scores``, ``route_top``, ``space_top``), which only decides where to
  search, its error bound widening the certificate;
* the block screen (``queries``: a chunk's query rows in the screen's type; ``screen``: a
  block's candidate pairs, re-scored in fp32, or None for the fp32 computation;
  ``rescores``) and the one-space screen (``space_rows``, ``space_screen``, ``space_block``);
* the low-precision copies of the sorted vectors (``low_copy``, ``space_copies``, and on disk
  ``copy_writer``, ``load_copy``).

``Fp32`` computes everything in fp32; ``Bf16`` screens with bf16 GEMMs and a proven margin
(screen.py). int8 lives in the ``stages/mining/int8`` package, which registers ``Int8`` when it
is importable: deleting that folder leaves fp32 and bf16 working, ``auto`` resolving to fp32,
and ``int8`` a ConfigError. Every precision keeps the same pairs (the screens are proven
supersets, re-scored in fp32)."""
from __future__ import annotations

import importlib
import os
from typing import Optional

import numpy as np
import torch
from vlcurate.foundation.params import ConfigError

from . import screen
from .core import _rows
from .kernels import _bias, _first, mapped, nearest


class Precision:
    """fp32: every GEMM in fp32, nothing screened, no low copy. The base of the others."""
    name = "fp32"
    dtype = torch.float32          # the float GEMMs that only decide where to look
    coarse_dtype = torch.float32   # a two-level layout's coarse centroids
    rescores = False               # the screen re-scores its pairs in fp32 (reads fp32 rows)
    space_copies = False           # the one-space layouts keep a low copy too
    auto_rank = 0                  # ``auto`` takes the highest-ranked native precision

    def native(self, device: str) -> bool:
        """Whether ``device`` runs this precision's GEMMs in hardware (``auto``)."""
        return True

    def margin(self, dim: int) -> float:
        """The largest |screened - re-scored| similarity of unit vectors of ``dim`` dims."""
        return 0.0

    # --- layout -------------------------------------------------------------------------------
    def assigned(self, x: torch.Tensor) -> torch.Tensor:
        """The rows k-means assigns, as ``nearest`` reads them (made once for every iteration)."""
        return x

    def nearest(self, x: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
        """argmax_c <x_i, cent_c> (kernels.nearest, in ``dtype``)."""
        return nearest(x, cent, self.dtype)

    # --- routing ------------------------------------------------------------------------------
    def routing_scores(self, lay, x: torch.Tensor) -> tuple:
        """(routing.mean_scores in this precision, the largest |score - fp32 score|)."""
        means = lay.cached("means", x.device, self.name, lambda: lay.means, self.dtype)
        return torch.addmm(_bias(lay, x.device), x, means.T), 0.0

    def route_top(self, lay, x: torch.Tensor, probe: int, own, reach) -> tuple:
        """((each row's probe best clusters, own first; the best score + reach over the others),
        the scores' error bound)."""
        from .. import native
        m, err = self.routing_scores(lay, x)
        return native.top_columns(_first(m, own), probe, reach), err

    def space_rows(self, x: torch.Tensor):
        """A one-space search's queries prepared once for routing and screening (None: x)."""
        return None

    def space_top(self, lay, x: torch.Tensor, probe: int, rows=None) -> np.ndarray:
        """[n, probe] the one-space routing (``rows``: space_rows' slice for x)."""
        return self.route_top(lay, x, probe, None, None)[0][0]

    # --- screens ------------------------------------------------------------------------------
    def queries(self, x: dict) -> dict:
        """The vectors of ``x`` (by name) as the screen's GEMMs take them."""
        return x

    def screen(self, q, blocks: list, floors: dict, tau_i: float, tau_t: float,
               own: torch.Tensor, members: Optional[tuple]):
        """screen.ragged_pairs' answer from a low-precision screen, or None: computed in fp32."""
        return None

    def space_screen(self, x: torch.Tensor, rows, floor: float) -> tuple:
        """(queries as the one-space blocks take them, the floor they are screened at, the
        hits function: screen.hits' signature)."""
        return x, floor, screen.hits

    def space_block(self, copy, members, rows: slice, cluster: int, x, device):
        """One-space members ``rows`` of ``cluster`` as the queries x take them."""
        return _rows(members, rows.start, rows.stop, device).to(x.dtype)

    def space_count(self, copy, x, bounds: np.ndarray, floor: float):
        """count.py's screen of whole ranges of sorted members at once, or None (it screens
        cluster by cluster: space_block, hits). Else a function (rows, skip [rows, C] bool, a,
        b, cap) -> (index into rows, member, the member it stopped at) of the pairs of the
        queries x[rows] (space_screen's) x members a:b above ``floor``: a proven superset, the
        (row, cluster) pairs ``skip`` left out; it stops before it might hold more than ``cap``
        pairs (or 32 x len(rows) rounded up to 32, if more), at a member it returns."""
        return None

    # --- low copies ---------------------------------------------------------------------------
    def low_copy(self, x: np.ndarray, lay):
        """Sorted rows' copy in this precision (None: none)."""
        return None

    def copy_writer(self, dir_: str, name: str, lay):
        """A writer of ``name``'s low copy, whole clusters at a time (None: none)."""
        return None

    def load_copy(self, dir_: str, name: str, n: int, d: int):
        """``name``'s stored low copy in ``dir_`` (None: none there)."""
        return None


Fp32 = Precision


class Bf16(Precision):
    """bf16 GEMMs screen the pairs within a proven margin; the pairs that pass are re-scored
    in fp32 (screen.py). The layout and routing GEMMs run in bf16 too."""
    name = "bf16"
    dtype = coarse_dtype = torch.bfloat16
    unit_roundoff = 2.0 ** -8
    rescores = True
    auto_rank = -1                 # never chosen by auto

    def margin(self, dim: int) -> float:
        return 3.1 * self.unit_roundoff + 2 * dim * 2.0 ** -24

    def routing_scores(self, lay, x: torch.Tensor) -> tuple:
        bias = _bias(lay, x.device)
        means = lay.cached("means", x.device, self.name, lambda: lay.means, self.dtype)
        screen.fp32_sums(x)       # routing may run before the screen's first cast
        # the bias in fp32: only the GEMM's rounding is the margin's
        return (x.to(self.dtype) @ means.T).float().add_(bias), self.margin(x.shape[1])

    def queries(self, x: dict) -> dict:
        for v in x.values():
            screen.fp32_sums(v)
        return {f: None if v is None else v.to(self.dtype) for f, v in x.items()}

    def screen(self, q, blocks, floors, tau_i, tau_t, own, members):
        s = screen.flat_sims(q.low, [(a, b, mlow or self.queries(m), len(m["img"]))
                                     for a, b, m, mlow in blocks])
        flat = screen.flat_candidates(s, floors, tau_i, tau_t, self.margin(q.dim), own)
        if len(flat) <= screen.DENSE_SHARE * s["sii"].numel():
            return screen.rescore_flat(q, blocks, flat, members)
        return screen.dense_pairs(q, blocks, flat, members)

    def space_screen(self, x, rows, floor):
        return self.queries({"x": x})["x"], floor - self.margin(x.shape[1]), screen.hits

    def low_copy(self, x, lay):
        return self.bits(x)

    def bits(self, x: np.ndarray) -> np.ndarray:
        """float32 [n, d] -> the int16 bits of its bf16 copy, for disk."""
        return torch.from_numpy(x).to(self.dtype).view(torch.int16).numpy()

    def copy_writer(self, dir_, name, lay):
        return _BitsWriter(open(os.path.join(dir_, f"{name}.{self.name}"), "wb"), self.bits)

    def load_copy(self, dir_, name, n, d):
        path = os.path.join(dir_, f"{name}.{self.name}")
        return mapped(path, np.int16, (n, d)) if os.path.exists(path) and n else None


class _BitsWriter:
    """A low copy written block by block (``bits`` of each)."""

    def __init__(self, fh, bits) -> None:
        self.fh, self.bits = fh, bits

    def write(self, block: np.ndarray, a: int, b: int) -> None:
        self.fh.write(self.bits(block).tobytes())

    def close(self) -> None:
        self.fh.close()


_REGISTRY: dict = {"fp32": Fp32(), "bf16": Bf16()}
PLUGINS = ("vlcurate.stages.mining.int8",)     # each registers its precision when importable
_loaded = False


def register(p: Precision) -> None:
    _REGISTRY[p.name] = p


def registry() -> dict:
    """Every precision available here, by name (the plug-in packages imported once)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in PLUGINS:
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as e:
                if not mod.startswith(e.name or "\0"):
                    raise
    return _REGISTRY


def get(precision) -> Precision:
    """The precision named ``precision`` (a Precision as it is)."""
    if isinstance(precision, Precision):
        return precision
    got = registry().get(precision)
    if got is None:
        raise ConfigError(f"hpm.engine.precision {precision!r} is not available here (available: "
                          f"{', '.join(registry())}, auto); int8 needs the package "
                          f"vlcurate.stages.mining.int8")
    return got


def resolve(precision: str, device: str) -> Precision:
    """hpm.engine.precision ``auto``: the highest-ranked precision whose GEMMs ``device`` runs in
    hardware (int8 where it has int8 GEMMs and the int8 package is here, else fp32); any
    other value as named."""
    if precision != "auto":
        return get(precision)
    return max((p for p in registry().values() if p.auto_rank >= 0 and p.native(device)),
               key=lambda p: p.auto_rank)


def margin(precision, dim: int) -> float:
    """The largest |screened - re-scored| similarity of unit vectors of ``dim`` dimensions."""
    return get(precision).margin(dim)


def low(x: dict, precision) -> dict:
    """The vectors of ``x`` in the screen's type (fp32: themselves; bf16: cast; int8: rows
    each with its own scale): the precision's ``queries``."""
    return get(precision).queries(x)
