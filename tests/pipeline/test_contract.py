"""The stage contract, checked over the default DAG: every stage is one of the four
kinds; the driver describes every stage (config view, output schema, notes, environment,
fingerprint) and constructs it without loading a model (model loads happen in ``setup()``)."""
import dataclasses

import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import default_dag
from vlcurate.pipeline.demo import DEMO_MODELS
from vlcurate.pipeline.runner import Runner, StageResult, stage_view
from vlcurate.foundation import models
from vlcurate.stages.base import GlobalStage, Kind, MapStage, SinkStage, SourceStage, Stage

KINDS = {Kind.SOURCE: SourceStage, Kind.MAP: MapStage, Kind.GLOBAL: GlobalStage,
         Kind.SINK: SinkStage}
LOADERS = ("load_timm", "load_sentence_transformer", "load_clip", "load_blip2", "load_backbone")


@pytest.fixture
def no_model_loads(monkeypatch):
    """Every model loader (and spaCy's) raises: whatever runs under this fixture loads none."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded on the driver")
    for name in LOADERS:
        monkeypatch.setattr(models, name, refuse)
    import spacy
    monkeypatch.setattr(spacy, "load", refuse)


def test_every_stage_is_one_kind_and_declares_its_sections():
    for node in default_dag():
        stage = node.stage
        assert isinstance(stage.kind, Kind) and issubclass(stage, KINDS[stage.kind]), stage
        for old in ("heavy_init", "config_sections", "source"):
            assert old not in vars(stage), f"{stage.name}: {old} is the old contract"
        for key, params in stage.sections().items():
            assert dataclasses.is_dataclass(params) and params.__dataclass_params__.frozen
            assert params.section == key or not dataclasses.fields(params) or \
                params.__name__ == "NoParams"
        cfg = C.default()
        for key in stage.reads:
            sec, _, name = key.partition(".")
            assert sec in {f.name for f in dataclasses.fields(cfg)}, (stage.name, key)
            assert not name or name in C.to_dict(cfg.section(sec)), (stage.name, key)


def test_the_driver_describes_and_builds_stages_without_loading_a_model(no_model_loads,
                                                                          tmp_path):
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True)
    (src / "captions.csv").write_text("image,caption\n")
    cfg = C.load(None, {**DEMO_MODELS, "source.path": str(src),
                        "run.run_dir": str(tmp_path / "run")})
    runner = Runner(cfg, executor="local")
    results = {}
    for node in runner.dag:
        view = stage_view(node.stage, cfg)
        schema = node.stage.output_schema({}, view)     # embed: widths from model configs
        node.stage.notes(view)
        fp, _ = runner.fingerprint(node, results)
        results[node.name] = StageResult({"fingerprint": fp}, "x")
        instance = node.stage(view, None, schema)       # cheap: setup() would load
        assert isinstance(instance, Stage)
    assert len(set(r.manifest["fingerprint"] for r in results.values())) == len(runner.dag)
