"""Adding a stage is four files (the stage, its schema module, a DAG line, its test): the
preflight, the guards and the schema collection find a stage through what it declares, so none
of them names one."""
import re
from pathlib import Path

from vlcurate.pipeline.dag import default_dag
from vlcurate.pipeline.guards import expected, knob
from vlcurate.schemas import reasons as R

REPO = Path(__file__).resolve().parents[2]
COLLECTING = ("pipeline/preflight.py", "pipeline/guards.py", "schemas/__init__.py",
              "schemas/reasons.py", "schemas/modules.py", "pyproject.toml",
              "tests/schemas/test_schemas.py")


def test_the_collecting_files_name_no_stage_but_the_spine():
    """The files that used to list stages by hand (a new stage meant editing each)."""
    stages = {n.name for n in default_dag()} - {"ingest", "export"}   # the spine stays named
    found = {}
    for path in COLLECTING:
        code = (REPO / path).read_text()
        hits = sorted(s for s in stages if re.search(rf"[\"']{s}[\"']", code))
        if hits:
            found[path] = hits
    assert not found, f"stage names listed by hand: {found}"


def test_every_declared_hook_reaches_the_guards():
    """Each stage's expected share and knobs, as the guards use them."""
    by_name = {n.name: n.stage for n in default_dag()}
    assert {n: s.expected_reject for n, s in by_name.items() if s.expected_reject is not None} \
        == {"ingest": 0.5, "ids": 0.05, "lang": 0.2, "cat": 0.75, "textspot": 0.3, "hpm": 0.5,
            "dedup": 0.3}
    assert expected("lang", 0.9) == 0.2 and expected("lang", 0.1) == 0.1
    assert expected("embed", 0.9) == 0.9          # no share of its own: the run's threshold
    assert knob(R.DUPLICATE_ID) == "source.key_column (the column that names each record)"
    assert knob(R.ZERO_BYTE).startswith("the source settings")     # the ingest.* pattern
    assert knob(R.CAT_TEXT_SPOTTED) == "textspot.min_chars / textspot.min_conf"
    models = [k for s in by_name.values() for k, _, _ in s.model_specs]
    assert models == ["embed.image_model", "embed.text_model", "embed.cross_model",
                      "recaption.model", "concepts.teacher"]
