"""Every config key with its default and its doc, from the ``Params`` (the one place a key is
documented): writes ``pipeline/configs/example.yaml`` and ``docs/config.md``, the reference.

    python -m vlcurate.pipeline.keys --write     # regenerate both after changing a Params
    python -m vlcurate.pipeline.keys             # exit 1 (naming the files) when either drifted

A section is a ``Params`` dataclass; a field holding another ``Params`` (``hpm.engine``) is a
nested section, except a model spec and ``resources``, whose fields are listed once
(``ModelSpec``, ``Resources``) and written as one flow mapping.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import yaml

from . import config as C
from vlcurate.foundation.params import ModelSpec, Resources, field_doc, to_dict

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "pipeline" / "configs" / "example.yaml"
REFERENCE = ROOT / "docs" / "config.md"
COMMAND = "python -m vlcurate.pipeline.keys --write"
WIDTH, COLUMN = 100, 32       # example.yaml's line width; where a key's inline doc starts
VALUES = (ModelSpec, Resources)   # written as one value, their fields documented once


def yaml_value(v: Any, short: bool = False) -> str:
    """``v`` as one line of YAML (flow style, fields in declaration order); ``short``: a model
    spec with only the fields it sets."""
    d = to_dict(v)
    if isinstance(v, Resources):               # unset fields: the stage's own
        d = {k: x for k, x in d.items() if x is not None}
    if short and isinstance(v, ModelSpec):     # the fields a spec sets (the rest: defaults)
        blank = to_dict(ModelSpec())
        d = {k: x for k, x in d.items() if k == "id" or x != blank[k]}
    text = yaml.safe_dump({"x": _plain(d)}, default_flow_style=True, width=10 ** 9,
                          sort_keys=False).strip()
    return text[len("{x: "):-1]


def _plain(v: Any) -> Any:
    """Mappings (a model's options) as plain dicts, which YAML writes."""
    return {k: _plain(x) for k, x in v.items()} if isinstance(v, dict) else \
        [_plain(x) for x in v] if isinstance(v, list) else v


def is_section(v: Any) -> bool:
    """A nested section (``hpm.engine``), not a value written as one mapping."""
    return dataclasses.is_dataclass(v) and not isinstance(v, VALUES)


def sections(config: Any) -> Iterator[tuple[str, Any]]:
    """(dotted name, Params instance) of every section and nested section, in order."""
    def walk(name: str, obj: Any) -> Iterator[tuple[str, Any]]:
        yield name, obj
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if is_section(v):
                yield from walk(f"{name}.{f.name}", v)
    for f in dataclasses.fields(config):
        yield from walk(f.name, getattr(config, f.name))


def first_sentence(doc: str) -> str:
    """Up to the first full stop that ends a sentence ("sec. 4.3" does not)."""
    return re.split(r"\.\s+(?=[A-Z])", " ".join(doc.split()))[0].rstrip(".").replace("``", "`")


def title(obj: Any, name: str = "") -> str:
    """A section's one-line description: its class docstring's first sentence; for a stage
    without parameters (``NoParams``), its module's."""
    from vlcurate.stages.base import NoParams
    if isinstance(obj, NoParams):
        from .dag import default_dag
        stage = next((n.stage for n in default_dag() if n.name == name), None)
        return first_sentence(sys.modules[stage.__module__].__doc__ or "") if stage else ""
    doc = type(obj).__doc__ or ""
    return "" if doc.startswith(type(obj).__name__ + "(") else first_sentence(doc)


def stage_resources() -> dict[str, Resources]:
    """{section: its stage's own resources defaults} (what an unset ``resources`` means)."""
    from .dag import default_dag
    return {n.name: n.stage.resources for n in default_dag()}


def doc_of(section: str, f: dataclasses.Field, own: dict[str, Resources]) -> str:
    if f.name == "resources":               # a stage's: unset fields are the stage's own
        mine = yaml_value(own.get(section, Resources()))
        return f"Ray resources; unset: the stage's own {mine}"
    return field_doc(f)


# --- example.yaml ------------------------------------------------------------------------------
HEADER = """\
# vlcurate config: every key with its default and what it means. Generated from the Params
# (python -m vlcurate.pipeline.keys --write): edit the field's doc= there, not this file.
# Values only (the DAG is Python: pipeline/dag.py). Every key is optional; an unknown key or a
# wrong type is an error naming the key. For a first run, start from a layout: coco.yaml,
# flickr.yaml, img2dataset.yaml, or small.yaml (offline, small data: the demo's models).
#
"""


def _comment(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH - len(indent) - 2, initial_indent=indent + "# ",
                         subsequent_indent=indent + "# ", break_on_hyphens=False)


def _value_docs() -> list[str]:
    """The header's lines documenting a model spec's and resources' fields."""
    out = []
    for cls, what in ((ModelSpec, "A model spec (a mapping: {id: ..., path: ...})"),
                      (Resources, "A stage's resources (a mapping: {num_gpus: 1, ...})")):
        out.append(f"# {what}:")
        for f in dataclasses.fields(cls):
            out += textwrap.wrap(f"{f.name}: {field_doc(f)}", WIDTH - 6, initial_indent="#   ",
                                 subsequent_indent="#     ", break_on_hyphens=False)
    return out


def _entry(line: str, doc: str, indent: str) -> list[str]:
    """``line`` with its doc inline at COLUMN, or (too long) as comment lines above it."""
    inline = f"{line:<{COLUMN - 1}} # {doc}" if doc else line
    return [inline] if len(inline) <= WIDTH else [*_comment(doc, indent), line]


def example_yaml(config: Any) -> str:
    """example.yaml's text: every section, nested ones nested, each key with its doc."""
    own, lines = stage_resources(), HEADER.splitlines() + _value_docs()

    def section(name: str, obj: Any, indent: str) -> None:
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if is_section(v):
                lines.extend(_entry(f"{indent}{f.name}:", field_doc(f), indent))
                section(f"{name}.{f.name}", v, indent + "  ")
            else:
                lines.extend(_entry(f"{indent}{f.name}: {yaml_value(v)}",
                                    doc_of(name, f, own), indent))

    for f in dataclasses.fields(config):
        obj = getattr(config, f.name)
        lines += ["", *_comment(title(obj, f.name), ""), f"{f.name}:"]
        section(f.name, obj, "  ")
    return "\n".join(lines) + "\n"


# --- docs/config.md ---------------------------------------------------------------------------
def _cell(text: str) -> str:
    """A table cell: pipes escaped, and a < that would open an HTML tag (<run_dir>)."""
    return re.sub(r"<(?=[A-Za-z/])", "&lt;", text.replace("|", "\\|").replace("\n", " "))


def _table(rows: list[tuple[str, str, str]]) -> list[str]:
    return ["| key | default | meaning |", "|---|---|---|",
            *(f"| `{k}` | `{_cell(v)}` | {_cell(d)} |" for k, v, d in rows)]


INTRO = f"""\
# Every config key

Generated from the `Params` (each stage's file, `pipeline/config.py`): do not edit by hand;
after changing a field's `doc=` or default, run `{COMMAND}`, which also writes
`pipeline/configs/example.yaml` (every key as YAML). A test fails when either drifts.

A config file holds values only; every key is optional, and an unknown key, a wrong type or a
bad value is an error naming the dotted key. `--set key=value` overrides any key (the value is
YAML). One table per section, nested sections (`hpm.engine`) in their own; the fields of a
model spec and of `resources` are listed once, at the end.
"""


def reference(config: Any) -> str:
    """docs/config.md: one table per section (nested sections their own), then the fields of a
    model spec and of resources."""
    own = stage_resources()
    out = [INTRO]
    for name, obj in [*sections(config), ("model spec", ModelSpec()),
                      ("resources", Resources())]:
        rows = [(f.name, yaml_value(getattr(obj, f.name), short=True), doc_of(name, f, own))
                for f in dataclasses.fields(obj) if not is_section(getattr(obj, f.name))]
        head = f"`{name}`" if " " not in name and name != "resources" else name
        out += [f"## {head}", "", title(obj, name), "", *_table(rows), ""]
    return "\n".join(out)


def generated() -> dict[Path, str]:
    """{file: its text as generated from the default config}."""
    config = C.default()
    return {EXAMPLE: example_yaml(config), REFERENCE: reference(config)}


def main(argv: list[str]) -> int:
    texts = generated()
    stale = [p for p, text in texts.items() if not p.exists() or p.read_text() != text]
    if "--write" in argv:
        for p in stale:
            p.write_text(texts[p])
        print("".join(f"wrote {p.relative_to(ROOT)}\n" for p in stale) or "up to date\n", end="")
        return 0
    for p in stale:
        print(f"{p.relative_to(ROOT)} is out of date: run {COMMAND}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
