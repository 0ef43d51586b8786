"""The config is documented once, in the Params: example.yaml and docs/config.md (the reference
of every key) are generated from them (pipeline/keys.py) and must not drift."""
import dataclasses

import pytest
import yaml

from vlcurate.pipeline import config as C
from vlcurate.pipeline import keys
from vlcurate.foundation.params import ModelSpec, Resources


def test_example_yaml_and_docs_config_md_are_generated_from_the_params():
    stale = [str(p.relative_to(keys.ROOT)) for p, text in keys.generated().items()
             if p.read_text() != text]
    assert not stale, f"{stale} drifted from the Params: regenerate with {keys.COMMAND}"


def test_example_yaml_loads_as_the_defaults():
    assert C.load(keys.EXAMPLE) == C.default()


def test_every_key_has_a_short_doc():
    cfg, own = C.default(), keys.stage_resources()
    fields = [(name, f) for name, obj in [*keys.sections(cfg), ("model", ModelSpec()),
                                          ("resources", Resources())]
              for f in dataclasses.fields(obj)]
    assert len(fields) > 200
    bad = [f"{name}.{f.name}" for name, f in fields
           if not 0 < len(keys.doc_of(name, f, own)) <= 250]
    assert not bad, f"fields without a doc (or one over 250 characters): {bad}"


def test_the_reference_has_a_table_per_section_and_short_cells():
    ref = keys.reference(C.default())
    for name in ("run", "hpm", "hpm.engine", "hpm.fast", "positives.candidates", "finetune"):
        assert f"\n## `{name}`\n" in ref
    cells = [c for line in ref.splitlines() if line.startswith("| `")
             for c in line.strip("|").split(" | ")]
    assert max(len(c) for c in cells) <= 300
    assert "| `probe` | `null` | clusters searched per row; null: calibrated" in ref


def test_a_changed_default_shows_as_drift():
    """The generator reads the fields: a new default changes example.yaml, so the drift test
    would fail until it is regenerated."""
    before = keys.example_yaml(C.default())
    cfg = C.default().replace(**{"hpm.engine.recall": 0.9})
    after = keys.example_yaml(cfg)
    assert "recall: 0.995" in before and "recall: 0.9 " in after
    assert yaml.safe_load(after)["hpm"]["engine"]["recall"] == 0.9


def test_the_readme_links_the_reference_and_the_reference_names_its_command():
    readme = (keys.ROOT / "README.md").read_text()
    assert "docs/config.md" in readme and "| `run_dir` |" not in readme
    assert keys.COMMAND in keys.reference(C.default()).split("\n## ")[0]


def test_the_command_reports_drift(tmp_path, monkeypatch, capsys):
    example = tmp_path / "example.yaml"
    example.write_text("run: {}\n")
    reference = tmp_path / "docs" / "config.md"
    reference.parent.mkdir()
    monkeypatch.setattr(keys, "EXAMPLE", example)
    monkeypatch.setattr(keys, "REFERENCE", reference)
    monkeypatch.setattr(keys, "ROOT", tmp_path)
    assert keys.main([]) == 1
    said = capsys.readouterr().out
    for name in ("example.yaml", "docs/config.md"):
        assert f"{name} is out of date: run {keys.COMMAND}" in said
    assert keys.main(["--write"]) == 0 and keys.main([]) == 0
    assert C.load(example) == C.default() and reference.read_text() == keys.reference(C.default())
