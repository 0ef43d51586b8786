"""engine/precision.py: hpm.engine.precision as objects the engine asks, and int8 as one package
(stages/mining/int8) that can be deleted in one step with fp32 and bf16 still working."""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from vlcurate.foundation.params import ConfigError
from vlcurate.stages.mining import engine as E
from vlcurate.stages.mining.engine import precision

from .test_blocks import cross_vectors, data, params

MINING = Path(E.__file__).resolve().parents[1]
OUTPUTS = ("idx", "score", "support", "certified", "offsets", "pair_j", "pair_sii", "pair_sit")

# mines the set in a process where the int8 package cannot be imported (as if deleted)
WITHOUT_INT8 = """
import pickle, sys
sys.modules["vlcurate.stages.mining.int8"] = None
import numpy as np
from vlcurate.foundation.params import ConfigError
from vlcurate.stages.mining import engine as E, pass_io
from vlcurate.stages.mining.engine import precision
from tests.stages.mining.test_precision import mine_all
img, txt, ximg, xtxt = np.load(sys.argv[1]).values()
errors = []
for name in ("int8", "fp16"):
    try:
        pass_io.resolve_precision(name, "cpu")
    except ConfigError as e:
        errors.append(str(e))
got = {"registry": list(precision.registry()),
       "auto": pass_io.resolve_precision("auto", "cpu"), "errors": errors,
       "results": mine_all(img, txt, ximg, xtxt)}
sys.stdout.buffer.write(pickle.dumps(got))
"""


def mine_all(img, txt, ximg, xtxt) -> dict:
    """Each of fp32 and bf16: a partial pass with one-space layouts, every output array."""
    out = {}
    for name in ("fp32", "bf16"):
        p = params(5, 6, probe=2, precision=name, space_probe=2, space_rows=40, max_pairs=9,
                   floor_i=0.6, floor_t=0.6, floor_x=0.5)
        _, r = E.neighbour_pass(img, txt, p, ximg, xtxt, rows=70)
        out[name] = {f: np.asarray(getattr(r, f)).tobytes() for f in OUTPUTS}
    return out


def test_without_the_int8_package_fp32_and_bf16_mine_the_same_bytes(tmp_path):
    img, txt = data()
    ximg, xtxt = cross_vectors(img, 1)
    np.savez(tmp_path / "set.npz", img, txt, ximg, xtxt)
    run = subprocess.run([sys.executable, "-c", WITHOUT_INT8, str(tmp_path / "set.npz")],
                         capture_output=True, cwd=Path(__file__).resolve().parents[3],
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"}, timeout=600)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    got = pickle.loads(run.stdout)
    assert got["registry"] == ["fp32", "bf16"] and got["auto"] == "fp32"
    assert len(got["errors"]) == 2 and all("is not available here" in e for e in got["errors"])
    assert "vlcurate.stages.mining.int8" in got["errors"][0]
    want = mine_all(img, txt, ximg, xtxt)              # here, with the int8 package
    assert got["results"] == want
    assert len(np.frombuffer(want["fp32"]["pair_j"], np.int64)) > 20


def test_every_precision_finds_the_same_pairs_through_the_one_entry_point():
    """The registry's precisions, the int8 package's included, through engine.mine: the same
    hard pairs and support, the same candidate pairs up to a similarity's last bits at a floor
    (a GEMM and a dot product round differently)."""
    img, txt = data()
    names = list(precision.registry())
    assert names == ["fp32", "bf16", "int8"]
    got = {}
    for name in names:
        p = params(5, 6, probe=2, precision=name, space_probe=2, space_rows=40, floor_i=0.6)
        lay, vec, spaces = E.prepare(img, txt, p)
        assert spaces and (vec.low is None) == (name == "fp32")
        got[name] = E.mine(lay, vec, lay.positions()[::-1], p, spaces=spaces)
    want = got["fp32"]
    pairs = set(zip(np.repeat(np.arange(len(want.support)), np.diff(want.offsets)), want.pair_j))
    assert len(pairs) > 100
    for name in names[1:]:
        for f in ("idx", "support"):
            np.testing.assert_array_equal(getattr(got[name], f), getattr(want, f), f)
        r = got[name]
        found = set(zip(np.repeat(np.arange(len(r.support)), np.diff(r.offsets)), r.pair_j))
        assert len(found ^ pairs) <= len(pairs) // 500, name


def test_auto_takes_the_highest_ranked_native_precision(monkeypatch):
    int8 = precision.get("int8")
    monkeypatch.setattr(type(int8), "native", lambda self, device: True)
    assert precision.resolve("auto", "cpu") is int8
    monkeypatch.setattr(type(int8), "native", lambda self, device: False)
    assert precision.resolve("auto", "cpu") is precision.get("fp32")
    assert precision.resolve("bf16", "cpu").name == "bf16"
    with pytest.raises(ConfigError, match="fp16"):
        precision.get("fp16")


def test_only_the_int8_package_names_int8_and_no_engine_code_compares_precision_names():
    """Deleting stages/mining/int8 is the whole of removing int8: nothing else imports it (the
    registry imports it by name, if present), and the engine asks its Precision instead of
    comparing names."""
    compare = re.compile(r"""[!=]=\s*["'](fp32|bf16|int8)["']|["'](fp32|bf16|int8)["']\s*[!=]=""")
    imports = re.compile(r"^\s*(from|import)\s[^\n]*\b(int8|q8)\b", re.M)
    files = [f for f in MINING.rglob("*.py") if "int8" not in f.relative_to(MINING).parts]
    assert len(files) > 15
    for f in files:
        text = f.read_text()
        assert not compare.search(text), f
        assert not imports.search(text), f
    assert not re.search(r"screen_int8|screen_pairs|vnni", (MINING / "native.c").read_text(), re.I)
