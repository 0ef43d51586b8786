"""The DAG, declared in Python. Config holds values only; which stages run, and after what, is
decided here. A stage's upstream is every stage it (transitively) runs after: their reasons
decide which rows it still computes on, and their fingerprints enter its own."""
from __future__ import annotations

from dataclasses import dataclass

from vlcurate.stages.base import Kind
from vlcurate.stages.cat.cat_stage import CatStage
from vlcurate.stages.cat.textspot_stage import TextSpotStage
from vlcurate.stages.concepts import ConceptsStage, TeacherStage
from vlcurate.stages.dedup import DedupStage
from vlcurate.stages.embed import EmbedStage, RecaptionEmbedStage
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from vlcurate.stages.lang import LangStage
from vlcurate.stages.mining.positives_stage import PositivesStage
from vlcurate.stages.mining.hpm_stage import HpmStage
from vlcurate.stages.recaption import RecaptionStage


@dataclass(frozen=True)
class Node:
    stage: type
    after: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.stage.name


def default_dag() -> list[Node]:
    return [
        Node(IngestStage),
        Node(IdsStage, after=("ingest",)),
        # language ID first: DiHT's CAT parse is English, and OCR costs ~1000x a caption
        Node(LangStage, after=("ids",)),
        # DiHT's CAT filter: the cheap parse first, OCR only on the captions it kept
        Node(CatStage, after=("lang",)),
        Node(TextSpotStage, after=("cat",)),
        # HELIP: embed the kept pairs, mine hard pairs (noise pairs flagged)
        Node(EmbedStage, after=("textspot",)),
        Node(HpmStage, after=("embed",)),
        # model-heavy annotations, only for rows every filter kept. FFF sec. 4.3 assigns the
        # positives over images x k captions, so the recaptions (and their cross-modal
        # embeddings) come before the positives; positives flags no row, so every stage still
        # sees the same rows as when recaption ran after it
        Node(RecaptionStage, after=("hpm",)),
        Node(RecaptionEmbedStage, after=("recaption",)),
        Node(PositivesStage, after=("recaption_embed",)),
        # near-duplicate groups keep their first row (the others: dedup.near_duplicate)
        Node(DedupStage, after=("positives",)),
        # the teacher beside dedup, not after it: a policy that keeps the twins (the small
        # config's does) exports them, and the concept terms of their loss need the teacher
        Node(TeacherStage, after=("positives",)),
        Node(ConceptsStage, after=("teacher",)),
        Node(ExportStage),   # a sink: after every stage declared before it
    ]


def select(dag: list[Node], names: "tuple[str, ...] | None") -> list[Node]:
    """The DAG restricted to ``names`` (``run.stages``); a kept stage that ran after a dropped one
    now runs after that stage's own dependencies. The source and export are always kept."""
    dag = with_sinks(dag)
    if not names:
        return dag
    known = {n.name for n in dag}
    unknown = sorted(set(names) - known)
    if unknown:
        from vlcurate.foundation.params import ConfigError
        raise ConfigError(f"run.stages: unknown stage(s) {unknown}; the DAG has {sorted(known)}")
    by_name = {n.name: n for n in dag}
    keep = set(names) | {dag[0].name} | ({"export"} & known)
    todo = list(keep)
    while todo:     # a kept stage's inputs are kept too (concepts reads the teacher's features)
        for up in by_name[todo.pop()].stage.inputs:
            if up in known and up not in keep:
                keep.add(up)
                todo.append(up)

    def deps(name: str) -> list[str]:
        out: list[str] = []
        for a in by_name[name].after:
            out += [a] if a in keep else deps(a)
        return out

    return [Node(n.stage, tuple(dict.fromkeys(deps(n.name)))) for n in dag if n.name in keep]


def with_sinks(dag: list[Node]) -> list[Node]:
    """A sink declared with no ``after`` runs after every stage declared before it (so a new
    stage is one line: export sees its reasons and columns)."""
    out: list[Node] = []
    for n in dag:
        if n.stage.kind == Kind.SINK and not n.after:
            n = Node(n.stage, tuple(m.name for m in out))
        out.append(n)
    return out


def topo_order(dag: list[Node]) -> list[Node]:
    """Declaration order, checked: names unique, every dependency declared before its user."""
    seen: set[str] = set()
    for n in dag:
        if n.name in seen:
            raise ValueError(f"stage {n.name!r} appears twice in the DAG")
        missing = [a for a in n.after if a not in seen]
        if missing:
            raise ValueError(f"stage {n.name!r} runs after {missing}, which are not declared before it")
        seen.add(n.name)
    sources = [n.name for n in dag if n.stage.kind == Kind.SOURCE]
    if len(sources) != 1 or dag[0].name != sources[0]:
        raise ValueError(f"the DAG must start with exactly one source stage, got {sources}")
    return list(dag)


def frontier(dag: list[Node], names: tuple[str, ...]) -> tuple[str, ...]:
    """Of ``names`` (a stage's ancestors), those that none of the others runs after: their
    commit records' flag levels already fold in the rest."""
    by_name = {n.name: n for n in dag}
    below = set().union(*(ancestors(dag, by_name[n]) for n in names))
    return tuple(n for n in names if n not in below)


def ancestors(dag: list[Node], node: Node) -> tuple[str, ...]:
    """Every stage ``node`` runs after, directly or not, in DAG order (the source first)."""
    by_name = {n.name: n for n in dag}
    out: set[str] = set()
    todo = list(node.after)
    while todo:
        a = todo.pop()
        if a not in out:
            out.add(a)
            todo.extend(by_name[a].after)
    return tuple(n.name for n in dag if n.name in out)
