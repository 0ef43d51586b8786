"""Adding a built-in stage is four files: the stage, its schema module, a DAG line, its test
(this file). A scratch copy of the package gets a stage ``wordcount`` that way: its table and
reason in its schema module, its preflight hook, expected share and knobs on its class. The copy
then collects the table and the reason, composes and checks the stage's section, runs its hook in
the preflight, names its knob in the guards, and runs it in the DAG. Nothing else is edited: no
list in schemas/, pipeline/ or pyproject.toml. (Its golden schema file is written by
``UPDATE_GOLDEN=1 pytest tests/schemas``.)"""
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOPS = ("schemas", "foundation", "stages", "trainer", "pipeline")

SCHEMA = '''
import pyarrow as pa

from .tables import stage_table

N_WORDS = pa.field("n_words", pa.int32(), metadata={"doc": "words in the caption"})
WORDCOUNT = stage_table(N_WORDS)

ALL = {"wordcount": WORDCOUNT}
REASON_CODES = {"WORDCOUNT_TOO_SHORT": "wordcount.too_short"}
'''

STAGE = '''
from dataclasses import dataclass

import pyarrow as pa

from vlcurate.foundation.params import Params, positive
from vlcurate.schemas import F
from vlcurate.schemas import reasons as R
from vlcurate.schemas import wordcount as S
from vlcurate.stages.base import Finding, MapStage, Resources


@dataclass(frozen=True)
class WordCountParams(Params):
    min_words: int = positive(3)
    resources: Resources = Resources()


class WordCountStage(MapStage):
    name = "wordcount"
    Params = WordCountParams
    inputs = {"ingest": (F.CAPTION,)}
    output = S.WORDCOUNT
    expected_reject = 0.25
    knobs = {R.WORDCOUNT_TOO_SHORT: "wordcount.min_words"}

    @classmethod
    def preflight(cls, config, stages):
        return [Finding(True, f"wordcount.min_words: {config.wordcount.min_words}")]

    def __call__(self, batch: pa.Table) -> pa.Table:
        words = [len(c.split()) for c in batch.column(F.CAPTION.name).to_pylist()]
        short = [w < self.config.wordcount.min_words for w in words]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         S.N_WORDS.name: pa.array(words, pa.int32()),
                         F.REASONS.name: [[R.WORDCOUNT_TOO_SHORT] if s else [] for s in short],
                         F.REASON_DETAIL.name: [None] * len(words)}, schema=self.output)
'''

PROBE = '''
import json, sys
from pathlib import Path
import vlcurate.pipeline.dag as D
from vlcurate import schemas
from vlcurate.schemas import reasons as R
from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.guards import expected, knob
from vlcurate.pipeline.preflight import preflight
from vlcurate.pipeline.runner import run

tmp = Path(sys.argv[1])
data = make_demo(tmp / "data", n=30, seed=2)
over = {**demo_overrides(data, tmp / "run"), "run.progress": False,
        "run.stages": ["wordcount"], "wordcount.min_words": 9}
cfg = C.load(None, over)
try:
    C.load(None, {**over, "wordcount.min_words": 0})
    refused = None
except C.ConfigError as e:
    refused = str(e)
names = [n.name for n in D.select(D.default_dag(), cfg.run.stages)]
out = {r.manifest["stage"]: r.manifest for r in run(cfg, executor="local", log=lambda _: None)}
print(json.dumps({
    "dag_file": D.__file__, "table": schemas.ALL_TABLES["wordcount"].names,
    "reason": R.WORDCOUNT_TOO_SHORT, "refused": refused, "stages": names,
    "preflight": [f.text for f in preflight(cfg, names)],
    "knob": knob("wordcount.too_short"), "expected": expected("wordcount", 0.9),
    "wordcount": out["wordcount"], "export": out["export"]}, default=str))
'''


def _scratch_copy(root: Path) -> None:
    for top in TOPS:
        shutil.copytree(REPO / top, root / "vlcurate" / top,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (root / "vlcurate" / "schemas" / "wordcount.py").write_text(SCHEMA.lstrip())
    (root / "vlcurate" / "stages" / "wordcount.py").write_text(STAGE.lstrip())
    dag = root / "vlcurate" / "pipeline" / "dag.py"
    text = dag.read_text()
    ids = '        Node(IdsStage, after=("ingest",)),\n'
    base = "from vlcurate.stages.base import Kind\n"
    assert ids in text and base in text
    line = "from vlcurate.stages.wordcount import WordCountStage\n"
    dag.write_text(text.replace(base, base + line)
                   .replace(ids, ids + '        Node(WordCountStage, after=("ids",)),\n'))


@pytest.mark.slow
def test_a_stage_added_in_its_four_files_is_collected_checked_and_run(tmp_path):
    _scratch_copy(tmp_path / "pkg")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg"), "RAY_AUTH_MODE": "disabled"}
    got = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), str(tmp_path)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-4000:]
    r = json.loads(got.stdout.strip().splitlines()[-1])
    assert r["dag_file"].startswith(str(tmp_path / "pkg"))       # the copy ran, not the repo
    assert r["table"] == ["sample_id", "n_words", "reasons", "reason_detail"]
    assert r["reason"] == "wordcount.too_short"
    assert r["refused"].startswith("wordcount.min_words: must be an int > 0")
    assert r["stages"] == ["ingest", "wordcount", "export"]
    assert "wordcount.min_words: 9" in r["preflight"]
    assert r["knob"] == "wordcount.min_words" and r["expected"] == 0.25
    m = r["wordcount"]
    assert m["rows_in"] == m["rows_kept"] + m["rows_rejected"] and m["rows_rejected"] > 0
    assert "wordcount.too_short" in str(m["reason_counts"])
    assert r["export"]["rows_kept"] < r["export"]["rows_in"]
