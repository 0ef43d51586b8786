"""A newcomer's own data works on the first run: the mistakes a fresh user makes while
following only the README, each answered by the ``vlcurate`` CLI (run as a user runs it, in a
subprocess) with a non-zero exit code (2, the project's convention for a user error), one clear
line that names the config key or what to do, and never a Python traceback.

The user starts, as the README says, from ``pipeline/configs/small.yaml`` (offline, small data),
copies it beside their data and edits values in it (``my.yaml``), or passes ``--set``. Their data
is the first Flickr8k photos of ``../shared/data/flickr8k_224`` with their five captions each when
present, else four rendered pictures in the same layout (``images/`` + ``captions.csv`` with
``image,caption,caption_idx,flickr8k_split``): the mistakes are about the config, so every case
runs on a fresh machine too.

The mistakes:
 1. ``source.key_column`` names a column the captions file lacks (``id``, as in ``coco.yaml``);
 2. ``source.caption_column`` names a column the captions file lacks;
 3. missing model weights: the README's DINO image encoder with no weights offline; preflight
    (``vlcurate check``) and ``vlcurate run`` both report it before any stage runs.
    3b and 3c are the same mistake in two more forms: ``embed.cross_model`` without weights, and
    ``embed.image_model.path`` set on small.yaml (as its own comment says to) while its
    ``random_init`` is still true;
 4. ``source.path`` that does not exist, or an empty folder;
 5. a typo in a config key (``hpm.kk: 3``); 5b: a typo in a stage name of ``run.stages``,
    the one config value that names stages;
 6. a rerun of ``vlcurate finetune`` into the same ``out_dir`` with another loss: refused, naming
    what changed (one demo run for the module, ``tests/pipeline/test_cli.py``'s fixture);
 7. ``run.max_reject_fraction`` exceeded: images not under ``images/`` (every row
    ``ingest.missing_file``) stops the run naming the top reason and the knob; 7b: with every
    caption too long
    the stop names the reason and its knob (``ingest.max_caption_chars``);
 8. ``cuda`` asked for on a machine without a GPU (``embed.image_model.device``,
    ``finetune.model.device``): the preflight (and finetune's check before torchrun) names the
    key. Skipped on a machine with a GPU;
 9. a typo in ``source.images_dir`` (or an image column that names no file): the preflight reads
    the first records and stops before any stage runs;
10. an ``extra_columns`` entry the captions file lacks: the preflight names it;
11. ``hpm.k`` above the rows kept for mining: the stage's small-data guard (a ``DataError``) is
    one line, also when a Ray worker raised it;
12. a run that exports no row: exit 2, the funnel and the reasons with their settings;
    ``run.allow_empty: true`` accepts it.
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.paths import SHARED_DATA
from tests.pipeline.test_cli import demo_run  # noqa: F401  (fixture: one demo run, n=30, local)
from tests.pipeline.test_layout_configs import CONFIGS, flickr_slice

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
       "HF_HUB_OFFLINE": "1"}
TINY_CLIP = "finetune.model={id: tiny, random_init: true}"
FT_QUICK = ("--nproc", "1", "--set", TINY_CLIP, "--set", "finetune.batch_size=2",
            "--set", "finetune.steps=1", "--set", "finetune.progress=false",
            "--set", "finetune.eval_fraction=0")


def vlc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlcurate.pipeline.cli", *map(str, args)],
                          env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=300,
                          check=False)


def failed(res: subprocess.CompletedProcess, code: int = 2) -> str:
    """stdout + stderr of a command that must fail with ``code`` and no traceback."""
    text = res.stdout + res.stderr
    assert "Traceback" not in text, text[-3000:]
    assert res.returncode == code, text[-3000:]
    return text


def problem_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("PROBLEM  ")]


# --- the user's data and config -------------------------------------------------------------
def _synthetic(root: Path) -> Path:
    from PIL import Image
    (root / "images").mkdir(parents=True)
    rows = []
    for i, (colour, what) in enumerate([("red", "a dog running on the grass"),
                                        ("blue", "a boy jumping into a lake"),
                                        ("green", "two girls playing football in a park"),
                                        ("orange", "a man riding a bike down a street")]):
        Image.new("RGB", (96, 80), colour).save(root / "images" / f"{i}.jpg")
        rows += [{"image": f"{i}.jpg", "caption": c, "caption_idx": n, "flickr8k_split": "train"}
                 for n, c in enumerate([what, f"{what} on a sunny day"])]
    _write_captions(root, rows)
    return root


def _write_captions(root: Path, rows: list[dict]) -> None:
    with open(root / "captions.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _captions(root: Path) -> list[dict]:
    with open(root / "captions.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def user_data(tmp_path_factory) -> Path:
    """A folder source as the README describes it: ``images/`` and ``captions.csv``."""
    root = tmp_path_factory.mktemp("fresh") / "pairs"
    if (SHARED_DATA / "flickr8k_224").exists():
        return flickr_slice(root, 4)                 # 4 real photos, 20 real captions
    return _synthetic(root)


def user_config(tmp_path: Path, data: Path, **sections: dict) -> Path:
    """``small.yaml`` copied beside the user's data, each given section's keys replaced."""
    cfg = yaml.safe_load((CONFIGS / "small.yaml").read_text())
    cfg["source"]["path"] = str(data)
    cfg["run"] = {**cfg["run"], "run_dir": str(tmp_path / "run"), "progress": False}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


# --- 1, 2: a column the captions file lacks -------------------------------------------------
def test_1_wrong_key_column(user_data, tmp_path):
    conf = user_config(tmp_path, user_data, source={"key_column": "id"})
    text = failed(vlc("check", conf))
    assert problem_lines(text) == [(
        f"PROBLEM  source: {user_data / 'captions.csv'}: no column 'id' (source.key_column); "
        "columns: ['caption', 'caption_idx', 'flickr8k_split', 'image']")]
    assert "1 problem(s): fix them and rerun (nothing has run yet)" in text


def test_2_wrong_caption_column(user_data, tmp_path):
    conf = user_config(tmp_path, user_data, source={"caption_column": "text"})
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    assert res.stderr == (
        "preflight found problems; nothing has run yet:\n"
        f"  - source: {user_data / 'captions.csv'}: no column 'text' (source.caption_column); "
        "columns: ['caption', 'caption_idx', 'flickr8k_split', 'image']\n")
    assert not (tmp_path / "run").exists()


# --- 3: missing model weights ---------------------------------------------------------------
DINO_MISSING = ("embed.image_model: image encoder 'vit_small_patch8_224.dino': no local weights "
                "(timm/vit_small_patch8_224.dino). Set its `path` to a local file or folder")


def test_3_missing_weights_before_any_stage_runs(user_data, tmp_path):
    """The README's own image encoder (DINO) in place of small.yaml's random stand-in, on a
    machine whose Hugging Face cache is empty (offline): check and run both say what to do."""
    conf = user_config(tmp_path, user_data,
                       embed={"image_model": {"id": "vit_small_patch8_224.dino"}})
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    text = failed(vlc("check", conf, env=env))
    bad = problem_lines(text)
    assert len(bad) == 1 and bad[0].startswith("PROBLEM  " + DINO_MISSING), text
    assert "allow_download: true" in bad[0] and "random_init: true" in bad[0]
    res = vlc("run", conf, "--executor", "local", env=env)
    failed(res)
    lines = res.stderr.splitlines()
    assert lines[0] == "preflight found problems; nothing has run yet:" and len(lines) == 2
    assert lines[1].startswith("  - " + DINO_MISSING)
    assert not (tmp_path / "run").exists()                  # no stage ran


def test_3b_missing_cross_model_weights(user_data, tmp_path):
    conf = user_config(tmp_path, user_data,
                       embed={"cross_model": {"id": "openai/clip-vit-large-patch14"}})
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub")}
    text = failed(vlc("check", conf, env=env))
    bad = problem_lines(text)
    assert len(bad) == 1 and bad[0].startswith(
        "PROBLEM  embed.cross_model: cross-modal encoder 'openai/clip-vit-large-patch14': no "
        "local weights (openai/clip-vit-large-patch14)."), text


def test_3c_a_weights_path_on_small_yaml_is_not_ignored(user_data, tmp_path):
    """small.yaml's cross model has random weights; a path set on it is never silently ignored:
    the config says to turn random_init off, and then the preflight looks for the file. A path on
    the packaged image model (real weights, no random_init) is looked for at once."""
    conf = user_config(tmp_path, user_data)
    res = vlc("check", conf, "--set", "embed.cross_model.path=/models/clip.pth")
    failed(res)
    assert res.stderr == ("error: embed.cross_model.path: is set (/models/clip.pth) but "
                          "random_init is true, which would ignore it: set random_init: false "
                          "to load these weights\n")
    text = failed(vlc("check", conf, "--set", "embed.cross_model.path=/models/clip.pth",
                      "--set", "embed.cross_model.random_init=false"))
    bad = problem_lines(text)
    assert len(bad) == 1 and bad[0].startswith("PROBLEM  embed.cross_model: ") \
        and "/models/clip.pth" in bad[0], text
    bad = problem_lines(failed(vlc("check", conf, "--set", "embed.image_model.path=/m/w.pth")))
    assert bad == ["PROBLEM  embed.image_model: image encoder 'tf_efficientnet_lite0': "
                   "path /m/w.pth does not exist"], bad


# --- 4: no data where source.path points ----------------------------------------------------
def test_4_source_path_missing_or_empty(tmp_path):
    nowhere = tmp_path / "my-pairs"
    res = vlc("run", user_config(tmp_path, nowhere), "--executor", "local")
    failed(res)
    assert res.stderr == ("preflight found problems; nothing has run yet:\n"
                          f"  - source: source.path does not exist: '{nowhere}'\n")
    assert not (tmp_path / "run").exists()
    nowhere.mkdir()                                          # the folder, still empty
    text = failed(vlc("check", user_config(tmp_path, nowhere)))
    assert problem_lines(text) == [(
        f"PROBLEM  source: no captions file in {nowhere}: expected one of captions.csv, "
        "captions.jsonl, metadata.jsonl, captions.tsv or set source.captions_file")]


# --- 5: a typo in a key ---------------------------------------------------------------------
def test_5_typo_in_a_config_key(user_data, tmp_path):
    conf = user_config(tmp_path, user_data, hpm={"kk": 3})
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    assert res.stderr == "error: hpm.kk: unknown key (did you mean 'k'?)\n"
    res = vlc("check", user_config(tmp_path, user_data), "--set", "ingest.max_caption_char=300")
    failed(res)
    assert res.stderr == "error: ingest.max_caption_char: unknown key (did you mean " \
                         "'max_caption_chars'?)\n"
    assert not (tmp_path / "run").exists()


def test_5b_typo_in_a_stage_name(user_data, tmp_path):
    res = vlc("check", user_config(tmp_path, user_data), "--set", "run.stages=[hmp]")
    failed(res)
    assert res.stderr.startswith("error: run.stages: unknown stage(s) ['hmp']; the DAG has [")


# --- 6: finetune again into the same out_dir with another loss -------------------------------
def test_6_finetune_rerun_with_another_loss_is_refused(demo_run, tmp_path):  # noqa: F811
    out, _ = demo_run
    ft = tmp_path / "ft"
    first = vlc("finetune", out / "run", *FT_QUICK, "--set", f"finetune.out_dir={ft}")
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    ckpt = (ft / "checkpoint.pt").stat().st_mtime_ns
    res = vlc("finetune", out / "run", *FT_QUICK, "--set", f"finetune.out_dir={ft}",
              "--set", "finetune.loss=helip")
    failed(res)
    assert res.stderr == (
        f"error: finetune.out_dir {ft} holds a run of another training config "
        "(loss: \"clip\" -> \"helip\"); resuming needs the same one: set a new finetune.out_dir, "
        f"or delete {ft} to start over\n")
    assert "finetune: 1 process(es)" not in res.stdout      # refused before torchrun
    assert (ft / "checkpoint.pt").stat().st_mtime_ns == ckpt


# --- 7: run.max_reject_fraction -------------------------------------------------------------
def test_7_max_reject_fraction_names_the_top_reason_and_the_knob(user_data, tmp_path):
    """The user's photos are in ``photos/``, not ``images/``: every row is
    ``ingest.missing_file`` and the run stops after ingest, naming the settings to check. (Here
    only the first picture is in ``images/``: the preflight finds it, so the run starts.)"""
    import shutil
    data = tmp_path / "pairs"
    shutil.copytree(user_data / "images", data / "photos")
    shutil.copy(user_data / "captions.csv", data / "captions.csv")
    rows = _captions(data)
    (data / "images").mkdir()
    shutil.copy(data / "photos" / rows[0]["image"], data / "images")
    n, missing = len(rows), sum(r["image"] != rows[0]["image"] for r in rows)
    conf = user_config(tmp_path, data, run={"max_reject_fraction": 0.5})
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    assert res.stderr == (
        f"error: ingest flagged {missing} of the {n} rows it saw ({missing / n:.0%}); top reason "
        f"ingest.missing_file ({missing} rows): check source.path / source.images_dir / "
        "source.image_column. The run stops "
        "here because run.max_reject_fraction is 0.5; committed stages are kept, rerun after "
        "changing the setting\n")
    assert (tmp_path / "run" / "ingest" / "_manifest.json").exists()
    assert not (tmp_path / "run" / "ids").exists()           # nothing after the stage ran


def test_7b_every_caption_too_long_names_its_knob(user_data, tmp_path):
    import shutil
    data = tmp_path / "pairs"
    shutil.copytree(user_data / "images", data / "images")
    rows = [dict(r, caption=" ".join([r["caption"]] * (2100 // len(r["caption"]) + 1))[:2100])
            for r in _captions(user_data)]                   # real or fallback captions alike
    assert all(len(r["caption"]) > 2048 for r in rows)     # over ingest.max_caption_chars
    _write_captions(data, rows)
    conf = user_config(tmp_path, data, run={"max_reject_fraction": 0.5})
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("error: ingest flagged ")
    assert "top reason ingest.caption_too_long" in line
    assert "run.max_reject_fraction is 0.5" in line
    assert "check ingest.max_caption_chars" in line


# --- 8: cuda on a machine without a GPU -----------------------------------------------------
@pytest.fixture
def no_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: asking for cuda is no mistake here")


def test_8_cuda_without_a_gpu_names_the_key(no_gpu, user_data, tmp_path):
    conf = user_config(tmp_path, user_data)
    wish = ("--set", "embed.image_model.device=cuda")
    text = failed(vlc("check", conf, *wish))
    bad = problem_lines(text)
    assert len(bad) == 1 and bad[0].startswith("PROBLEM  embed.image_model.device"), text
    assert "no CUDA GPU" in bad[0]
    res = vlc("run", conf, "--executor", "local", *wish)
    failed(res)
    lines = res.stderr.splitlines()
    assert lines[0] == "preflight found problems; nothing has run yet:" and len(lines) == 2
    assert lines[1].startswith("  - embed.image_model.device")
    assert not (tmp_path / "run").exists()


def test_8b_finetune_cuda_without_a_gpu_names_the_key(no_gpu, demo_run, tmp_path):  # noqa: F811
    out, _ = demo_run
    res = vlc("finetune", out / "run", *FT_QUICK, "--set", f"finetune.out_dir={tmp_path / 'ft'}",
              "--set", "finetune.model.device=cuda")
    failed(res)
    assert res.stderr.startswith("error: finetune.model.device is 'cuda' but torch sees no CUDA "
                                 "GPU") and res.stderr.count("\n") == 1


# --- 9, 10: a source misread, found before anything runs -------------------------------------
def test_9_typo_in_images_dir_stops_before_any_stage(user_data, tmp_path):
    """``images_dir: image`` (for ``images``): every row would be ``ingest.missing_file``; the
    preflight reads the first records as the run would and stops."""
    conf = user_config(tmp_path, user_data, source={"images_dir": "image"})
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    first = _captions(user_data)[0]["image"]
    assert res.stderr == (
        "preflight found problems; nothing has run yet:\n"
        f"  - source.images_dir: none of the first {min(32, len(_captions(user_data)))} records' "
        f"images is in {user_data / 'image'} (e.g. {first!r} is not there); set "
        "source.images_dir (relative to source.path; \"\" for the folder itself), or "
        "source.image_column ('image') to the column of image file names\n")
    assert not (tmp_path / "run").exists()
    # the image column pointing at the captions: the same finding
    text = failed(vlc("check", conf, "--set", "source.images_dir=images",
                      "--set", "source.image_column=caption"))
    bad = problem_lines(text)
    assert len(bad) == 1 and bad[0].startswith("PROBLEM  source.images_dir: none of the first")


def test_10_missing_extra_column_stops_before_any_stage(user_data, tmp_path):
    conf = user_config(tmp_path, user_data, source={"extra_columns": ["flickr8k_split", "url"]})
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    assert res.stderr == (
        "preflight found problems; nothing has run yet:\n"
        "  - source.extra_columns: the source has no column 'url' (columns: ['caption', "
        "'caption_idx', 'flickr8k_split', 'image']); remove it from source.extra_columns or fix "
        "its name\n")
    assert not (tmp_path / "run").exists()


# --- 11: a stage's small-data guard ----------------------------------------------------------
def test_11_hpm_small_data_guard_is_one_line(user_data, tmp_path):
    """HELIP's noise rule with hpm.k above the rows kept for mining: the stage raises its
    DataError in its global step; the CLI prints it as one line naming hpm.k."""
    conf = user_config(tmp_path, user_data, hpm={"k": 500}, cat={"require_action": False,
                                                                  "min_complexity": -1})
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    line = res.stderr.strip()
    assert "\n" not in line and line.startswith("error: hpm.k = 500 cannot be supported by the "), \
        res.stderr
    assert "Set hpm.k to at most" in line


def test_11b_a_stage_error_raised_in_a_ray_worker_is_unwrapped():
    """Under Ray the global step's error arrives wrapped (RayTaskError, with the worker's
    traceback in its text); the CLI finds the user's error inside and prints only it."""
    from ray.exceptions import RayTaskError
    from vlcurate.pipeline.cli import user_error
    from vlcurate.foundation.params import DataError
    cause = DataError("hpm.k = 500 cannot be supported by the 8 rows kept for mining")
    wrapped = RayTaskError("prepare_step", "Traceback (most recent call last):\n  ...", cause)
    for err in (wrapped, wrapped.as_instanceof_cause()):
        assert user_error(err) is cause
    try:
        raise RuntimeError("a map task failed") from wrapped.as_instanceof_cause()
    except RuntimeError as chained:                # Ray Data: the user's error as the cause
        assert user_error(chained) is cause
    assert user_error(RuntimeError("a bug")) is None   # a bug keeps its traceback


# --- 12: no silent empty result --------------------------------------------------------------
def test_12_a_run_that_exports_nothing_exits_2_naming_the_reasons(user_data, tmp_path):
    conf = user_config(tmp_path, user_data, lang={"keep": ["fr"]})
    n = len(_captions(user_data))
    res = vlc("run", conf, "--executor", "local")
    failed(res)
    assert res.stderr.endswith(
        f"error: the run exported none of its {n} rows (the summary and the reasons above say "
        "why); change the settings named there, or set run.allow_empty: true to accept an "
        "empty result\n")
    assert res.stderr.count("error:") == 1
    out = res.stdout
    assert "rows in = rows kept + rows rejected" in out                  # the funnel
    assert "the reasons that dropped the rows (a row may have several):" in out
    assert f"  lang.other: {n} rows; check lang.keep" in out and "lang.min_prob" in out
    assert "export.drop is ['ingest.*', 'lang.*', 'cat.*', 'hpm.*']" in out
    assert "[lang] WARNING: lang flagged" in out                          # its own guard too
    ok = vlc("run", conf, "--executor", "local", "--set", "run.allow_empty=true")
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-2000:]
    assert f"the run exported none of its {n} rows (run.allow_empty is true)" in ok.stdout
