import dataclasses

import pytest

from vlcurate.pipeline import config as C


def test_defaults_and_frozen():
    cfg = C.load()
    assert cfg.ingest.max_caption_chars == 2048 and cfg.export.drop == ("*",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ingest.max_pixels = 1


def test_yaml_file_and_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "source:\n  path: data\n  rows_per_part: 10\ningest:\n  resources: {num_cpus: 2}\n")
    cfg = C.load(tmp_path / "c.yaml", ["export.drop=[cat.*, hpm.noise_pair]", "run.run_dir=/x"])
    assert cfg.source.path == str(tmp_path / "data")  # relative to the config file
    assert cfg.source.rows_per_part == 10 and cfg.ingest.resources.num_cpus == 2.0
    assert cfg.export.drop == ("cat.*", "hpm.noise_pair") and cfg.run.run_dir == "/x"


@pytest.mark.parametrize("data,match", [
    ({"ingest": {"max_pixel": 5}}, r"ingest\.max_pixel: unknown key \(did you mean 'max_pixels'\?\)"),
    ({"bogus": {}}, r"bogus: unknown key"),
    ({"ingest": {"max_pixels": "lots"}}, r"ingest\.max_pixels: expected int, got 'lots'"),
    ({"ingest": {"max_pixels": 0}}, r"ingest\.max_pixels: must be an int > 0"),
    ({"run": {"compute_on_flagged": "yes"}}, r"run\.compute_on_flagged: expected true/false"),
    ({"source": {"kind": "zip"}}, r"source\.kind: expected one of"),
    ({"export": {"drop": "cat.*"}}, r"export\.drop: expected a list"),
    ({"export": {"drop": [1]}}, r"export\.drop\[0\]: expected a string"),
    ({"ingest": {"resources": {"num_gpus": -1}}}, r"ingest\.resources\.num_gpus: must be >= 0"),
    ({"ingest": 3}, r"ingest: expected a mapping"),
])
def test_errors_name_the_key(data, match):
    with pytest.raises(C.ConfigError, match=match):
        C.from_dict(data)


def test_bad_files(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load(tmp_path / "nope.yaml")
    (tmp_path / "l.yaml").write_text("- a\n- b\n")
    with pytest.raises(C.ConfigError, match="mapping"):
        C.load(tmp_path / "l.yaml")
    with pytest.raises(C.ConfigError, match="KEY=VALUE"):
        C.load(None, ["export.drop"])


def test_replace_and_roundtrip():
    cfg = C.load(None, {"source.path": "/d"})
    again = C.from_dict(C.to_dict(cfg))
    assert again == cfg and C.to_json(again) == C.to_json(cfg)
    assert cfg.replace(**{"export.drop": []}).export.drop == ()


def test_frozen_map_is_read_only_hashable_and_picklable():
    import pickle
    cfg = C.load(None, {"embed.image_model.options": {"img_size": 32, "depth": 2}})
    opts = cfg.embed.image_model.options
    assert opts == {"img_size": 32, "depth": 2} and hash(cfg)
    with pytest.raises(TypeError):
        opts["depth"] = 3
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(C.ConfigError, match="embed.image_model.options: expected a mapping"):
        C.load(None, {"embed.image_model.options": [1]})


def test_a_partial_nested_value_keeps_the_fields_own_defaults():
    """`--set embed.image_model.path=X` sets the path of the default model, not of a model with
    no id (ModelSpec's own default)."""
    c = C.load(None, {"embed.image_model.path": "/models/dino.pth"})
    assert c.embed.image_model.id == "vit_small_patch8_224.dino"
    assert c.embed.image_model.path == "/models/dino.pth"
    c = C.load(None, {"concepts.teacher": {"random_init": True}})
    assert c.concepts.teacher.id == "torchvision/vit_h_14" and c.concepts.teacher.random_init
    assert dict(c.concepts.teacher.options) == {"weights": "IMAGENET1K_SWAG_LINEAR_V1"}
    # naming another model starts from a blank spec: no options of the default architecture
    c = C.load(None, {"concepts.teacher": {"id": "vit_tiny_patch16_224"}})
    assert dict(c.concepts.teacher.options) == {} and c.concepts.teacher.path is None


def test_a_model_path_with_random_init_is_an_error_but_an_old_snapshot_still_loads():
    spec = {"id": "vit_tiny_patch16_224", "random_init": True, "path": "/models/w.pth"}
    with pytest.raises(C.ConfigError, match="embed.image_model.path: is set .* random_init is "
                                            "true, which would ignore it"):
        C.from_dict({"embed": {"image_model": spec}})
    old = C.from_snapshot({"embed": {"image_model": spec}})        # a run.json of before the rule
    assert old.embed.image_model.random_init and old.embed.image_model.path is None
