"""``vlcurate report``: the page for a real demo run (every stage that has a table, rendered in
headless Chromium and checked by its pixels), the sections a run without some stages lists as
absent, and a 100k-row run rendered in bounded time and size."""
from __future__ import annotations

import base64
import io
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from vlcurate.pipeline import config as C
from vlcurate.pipeline.cli import main
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.report import render, svg_histogram, thumbnail, write_report
from vlcurate.pipeline.rundir import StageDir, write_json
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F, tables
from vlcurate.schemas import cat as CS
from vlcurate.schemas import mining as M
from vlcurate.schemas import embed as E
from vlcurate.schemas import recaption as RC

IMG_RE = re.compile(r'<img src="data:image/jpeg;base64,([A-Za-z0-9+/=]+)"')


def section(page: str, anchor: str) -> str:
    m = re.search(rf'<section id="{anchor}">(.*?)</section>', page, re.S)
    assert m, f"section {anchor} missing"
    return m.group(1)


# --- a real demo run with every stage that can run offline ------------------------------------
TEACHER = {"id": "vit_tiny_patch16_224", "random_init": True,
           "options": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48,
                       "num_heads": 2}}


def full_dag() -> list[Node]:
    """The demo's stages plus the ones still being wired into the default DAG (hpm, cat,
    textspot, recaption, concepts): the report must show all of them."""
    from vlcurate.stages.cat.cat_stage import CatStage
    from vlcurate.stages.cat.textspot_stage import TextSpotStage
    from vlcurate.stages.concepts import ConceptsStage, TeacherStage
    from vlcurate.stages.embed import EmbedStage
    from vlcurate.stages.export import ExportStage
    from vlcurate.stages.ids import IdsStage
    from vlcurate.stages.ingest import IngestStage
    from vlcurate.stages.mining.hpm_stage import HpmStage
    from vlcurate.stages.recaption import RecaptionStage
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)), Node(EmbedStage, after=("ids",)),
            Node(HpmStage, after=("embed",)), Node(CatStage, after=("ids",)),
            Node(TextSpotStage, after=("cat",)), Node(RecaptionStage, after=("textspot",)),
            Node(TeacherStage, after=("cat",)), Node(ConceptsStage, after=("teacher",)),
            Node(ExportStage, after=("ingest", "ids", "embed", "hpm", "cat", "textspot",
                                     "recaption", "teacher", "concepts"))]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    pytest.importorskip("en_ud_ewt_sm", reason="the UD spaCy pipeline (../shared/models) is needed")
    pytest.importorskip("rapidocr_onnxruntime")
    out = tmp_path_factory.mktemp("report")
    data = make_demo(out / "data", n=30)
    cfg = C.load(None, {
        **demo_overrides(data, out / "run"), "source.rows_per_part": 16, "run.progress": False,
        "hpm.k": 6, "hpm.tau_image": 0.0, "hpm.tau_text": 0.0,
        "cat.spacy_model": "en_ud_ewt_sm", "cat.require_action": False,
        "recaption.model": {"id": "Salesforce/blip2-opt-2.7b", "random_init": True},
        "recaption.max_new_tokens": 6, "recaption.batch_size": 8,
        "concepts.teacher": TEACHER, "concepts.min_object_count": 2,
        "concepts.min_attribute_count": 2, "concepts.min_sharedness": 1,
        "concepts.min_visualness": 0.0, "concepts.epochs": 1, "concepts.top_k": 3})
    run(cfg, dag=full_dag(), executor="local", log=lambda _: None)
    return out / "run"


@pytest.mark.slow
def test_report_of_a_demo_run_has_every_section(demo_run, tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(demo_run), "--out", str(out), "--sample", "4"]) == 0
    page = out.read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    funnel = section(page, "funnel")
    manifests = {n: json.loads((demo_run / n / "_manifest.json").read_text())
                 for n in ("ingest", "ids", "hpm", "cat", "textspot", "export")}
    for name, m in manifests.items():
        assert re.search(rf'<td class="l">{name}</td><td>{m["parts"]}</td><td>{m["rows_in"]}</td>'
                         rf'<td>{m["rows_kept"]}</td><td>{m["rows_rejected"]}</td>', funnel), name
        for code, n in m["reason_counts"].items():
            assert f"{code} <b>{n}</b>" in funnel
    hists = section(page, "histograms")
    for col in (CS.CAT_COMPLEXITY, CS.OCR_CONFS, M.HARD_SCORES, M.SUPPORT, RC.RECAPTION_SCORES,
                E.CROSS_SCORE):
        assert f"{col.name}: n=" in hists
    assert hists.count("<svg") == 6
    grid = section(page, "hard-pairs")
    assert grid.count('class="card target"') == 4
    assert len(IMG_RE.findall(grid)) >= 4 * 3        # targets and their hard pairs, with images
    assert "#1 score" in grid
    rejected = section(page, "rejected")
    for m in manifests.values():
        if m["stage"] != "export":
            for code in m["reason_counts"]:
                assert f"<h3>{code} " in rejected
    assert "no image" in rejected                     # the zero-byte / missing files have none
    rc = section(page, "recaptions")
    assert rc.count("<ol>") == 4 and "RANDOM weights" in rc
    assert section(page, "concepts").count("<tr>") == 5   # header + 4 rows
    # every thumbnail is a small, valid JPEG
    thumbs = IMG_RE.findall(page)
    for b in thumbs[:20]:
        im = Image.open(io.BytesIO(base64.b64decode(b)))
        assert im.format == "JPEG" and max(im.size) <= 112
    # positives did not run: listed as absent, never a crash
    assert "Positives of random targets" in page.split("<h2>")[0]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (Debian package `chromium`)")
    return exe


def screenshot(html: Path, png: Path, tmp: Path) -> np.ndarray:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp / 'chromium-profile'}",
           "--window-size=1400,3000", "--hide-scrollbars", f"--screenshot={png}", html.as_uri()]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    return np.asarray(Image.open(png).convert("RGB")).astype(np.int16)


@pytest.mark.slow
def test_report_screenshot_shows_the_image_grids(demo_run, tmp_path):
    page, info = render(demo_run, sample=4)
    assert "Hard pairs of random targets" in info["shown"]
    full = tmp_path / "report.html"
    full.write_text(page)
    # the same page with every thumbnail replaced by an empty box of the same size: the layout
    # is identical (sizes are fixed), so the pixels that differ are exactly the rendered images
    blank = tmp_path / "blank.html"
    blank.write_text(IMG_RE.sub('<img src="data:," ', page))
    a = screenshot(full, tmp_path / "report.png", tmp_path)
    b = screenshot(blank, tmp_path / "blank.png", tmp_path)
    assert a.shape == b.shape == (3000, 1400, 3)
    # not an empty page: plenty of ink and colours
    white = (a > 245).all(axis=2)
    assert white.mean() < 0.85
    assert len(np.unique(a.reshape(-1, 3) // 8, axis=0)) > 300
    # the images: thumbnail-sized blobs of changed pixels, several in a row (the grids)
    from scipy import ndimage
    diff = np.abs(a - b).sum(axis=2) > 30
    labels, _ = ndimage.label(ndimage.binary_closing(diff, iterations=3))
    boxes = [s for s in ndimage.find_objects(labels)
             if 60 <= s[0].stop - s[0].start <= 130 and 60 <= s[1].stop - s[1].start <= 130]
    assert len(boxes) >= 16, f"{len(boxes)} thumbnail-sized images rendered"
    tops = {}
    for s in boxes:
        tops.setdefault(s[0].start // 20, []).append(s)
    assert max(len(v) for v in tops.values()) >= 5     # a grid row: a target and its hard pairs
    # the thumbnails themselves are colourful (the demo's shapes), not flat grey boxes
    ys, xs = boxes[0]
    assert len(np.unique(a[ys, xs].reshape(-1, 3) // 16, axis=0)) > 8


# --- absent sections, helpers ------------------------------------------------------------------
def test_report_of_a_run_without_stages_lists_absent_sections(tmp_path):
    run_dir = synth_run(tmp_path, parts=2, rows=50, stages=("ingest",))
    page, info = render(run_dir)
    assert info["shown"] == ["Funnel", "Rejected examples by reason"]
    assert "Hard pairs of random targets" in info["absent"]
    assert "Recaptions beside the original captions" in info["absent"]
    assert "no stage table has the column hpm_hard_ids (the hpm stage did not run)" in page
    assert "Histogram: Caption complexity (CAT; -1 = no object)" in info["absent"]


def test_report_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "not a vlcurate run directory" in capsys.readouterr().err


def test_histogram_counts_and_thumbnail():
    svg = svg_histogram(np.array([0, 1, 1, 2, 2, 2, 7.0]), integer=True, marker=1, marker_label="m")
    counts = [int(c) for c in re.findall(r"<title>\d+: (\d+)</title>", svg)]
    assert counts == [1, 2, 3, 0, 0, 0, 0, 1]               # one bar per integer 0..7
    assert 'stroke="#c0392b"' in svg                          # the marker line
    svg = svg_histogram(np.array([0.05, 0.15, 0.95]), lo=0.0, hi=1.0, bins=10)
    assert [int(c) for c in re.findall(r": (\d+)</title>", svg)] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    buf = io.BytesIO()
    Image.new("RGB", (640, 320), (200, 10, 10)).save(buf, "JPEG")
    uri = thumbnail(buf.getvalue(), 64)
    im = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    assert im.size == (64, 32) and im.getpixel((30, 15))[0] > 150
    assert thumbnail(b"not an image", 64) is None and thumbnail(None, 64) is None


# --- a synthetic 100k-row run ------------------------------------------------------------------
def _jpegs(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (48, 48), (30 * i % 255, 90, 255 - 30 * i % 255)).save(buf, "JPEG")
        out.append(buf.getvalue())
    return out


def synth_run(root: Path, parts: int, rows: int, stages=("ingest", "cat", "textspot", "hpm",
                                                          "recaption"), k: int = 10) -> Path:
    """A run dir written through StageDir like the runner does: co-partitioned stage tables,
    rejects and manifests, with plausible values (no model runs)."""
    rng = np.random.default_rng(0)
    run_dir = root / "run"
    run_dir.mkdir(parents=True)
    write_json(run_dir / "run.json", {"config": {"cat": {"min_complexity": 1},
                                                 "textspot": {"min_conf": 0.8}, "hpm": {"k": k}},
                                      "dag": list(stages)})
    n = parts * rows
    ids = np.array([f"{i:016x}" for i in range(n)], dtype=object)
    jpegs = _jpegs(8)

    def reasons(mask, code):
        return pa.array([[code] if m else [] for m in mask], F.REASONS.type)

    def build(stage: str, sl: slice, p: int) -> tuple[pa.Table, list]:
        m = sl.stop - sl.start
        sid = pa.array(ids[sl], pa.string())
        if stage == "ingest":
            bad = rng.random(m) < 0.01
            t = pa.table({F.SAMPLE_ID.name: sid, F.KEY.name: sid,
                          F.CAPTION.name: [f"a red square number {i}"
                                           for i in range(sl.start, sl.stop)],
                          F.IMAGE.name: pa.array([None if b else jpegs[i % 8] for i, b in
                                                  zip(range(m), bad)], pa.binary()),
                          F.REASONS.name: reasons(bad, "ingest.undecodable_image")})
            return t, bad
        if stage == "cat":
            cx = rng.integers(-1, 5, m)
            return pa.table({F.SAMPLE_ID.name: sid,
                             CS.CAT_COMPLEXITY.name: pa.array(cx, pa.int16()),
                             F.REASONS.name: reasons(cx < 1, "cat.low_complexity")}), cx < 1
        if stage == "textspot":
            conf = [rng.random(rng.integers(0, 3)).astype(np.float32).tolist() for _ in range(m)]
            hit = np.array([bool(c) and max(c) > 0.97 for c in conf])
            return pa.table({F.SAMPLE_ID.name: sid,
                             CS.OCR_CONFS.name: pa.array(conf, CS.OCR_CONFS.type),
                             F.REASONS.name: reasons(hit, "cat.text_spotted")}), hit
        if stage == "hpm":
            sup = rng.integers(0, 4 * k, m)
            noise = sup < k
            hard = [[] if z else ids[rng.integers(0, n, k)].tolist() for z in noise]
            scores = [[] if z else np.sort(rng.random(k).astype(np.float32))[::-1].tolist()
                      for z in noise]
            return pa.table({F.SAMPLE_ID.name: sid,
                             M.HARD_IDS.name: pa.array(hard, M.HARD_IDS.type),
                             M.HARD_SCORES.name: pa.array(scores, M.HARD_SCORES.type),
                             M.SUPPORT.name: pa.array(sup, pa.int32()),
                             F.REASONS.name: reasons(noise, "hpm.noise_pair")}), noise
        caps = [[f"a square {j}" for j in range(5)] for _ in range(m)]
        return pa.table({F.SAMPLE_ID.name: sid,
                         RC.RECAPTIONS.name: pa.array(caps, RC.RECAPTIONS.type),
                         RC.RECAPTION_SCORES.name: pa.array([[-0.5, -0.6, -0.7, -0.8, -0.9]] * m,
                                                            RC.RECAPTION_SCORES.type),
                         F.REASONS.name: reasons(np.zeros(m, bool), "")}), np.zeros(m, bool)

    for stage in stages:
        sd = StageDir(run_dir, stage)
        sd.begin({"fingerprint": stage, "parts": parts})
        total = {"rows": 0, "rows_in": 0, "rows_kept": 0, "rows_rejected": 0}
        rc: dict[str, int] = {}
        for p in range(parts):
            t, bad = build(stage, slice(p * rows, (p + 1) * rows), p)
            code = t.column(F.REASONS.name)
            rej = t.filter(pa.array(bad)).select([F.SAMPLE_ID.name, F.REASONS.name])
            rej = tables.conform(rej.append_column(F.STAGE.name, pa.array([stage] * rej.num_rows)),
                                 tables.REJECTS)
            sd.write_fragment(p, 0, rows, t, rej)
            nb = int(np.sum(bad))
            counts = {"rows": rows, "rows_in": rows, "rows_kept": rows - nb, "rows_rejected": nb,
                      "reason_counts": {}}
            if nb:
                c = next(r[0] for r in code.to_pylist() if r)
                counts["reason_counts"] = {c: nb}
                rc[c] = rc.get(c, 0) + nb
            sd.commit(p, counts)
            for key in total:
                total[key] += counts[key]
        sd.finish({"stage": stage, "status": "complete", "fingerprint": stage, "upstream": {},
                   "config": "{}", "parts": parts, "parts_reused": 0, **total,
                   "reason_counts": rc, "wall_s": 1.0, "started_at": "t", "finished_at": "t",
                   "versions": {}})
    return run_dir


@pytest.fixture(scope="module")
def big_run(tmp_path_factory) -> Path:
    return synth_run(tmp_path_factory.mktemp("big"), parts=100, rows=1000)


def test_report_of_a_100k_row_run_is_fast_and_small(big_run, tmp_path):
    t0 = time.time()
    path, info = write_report(big_run, tmp_path / "big.html", sample=8)
    took = time.time() - t0
    assert took < 30, f"report took {took:.1f}s"
    assert info["bytes"] < 1_500_000
    assert info["parts"] == 100 and info["stat_parts"] == 100     # 100k rows <= stats_rows
    # images come from the ingest parts that hold the shown rows, not from every part
    assert info["ingest_parts_read"] <= 8 * 11 + 4 * 6
    page = path.read_text()
    assert page.count('class="card target"') == 8
    assert "cat_complexity: n=100000," in page
    for code in ("cat.low_complexity", "cat.text_spotted", "hpm.noise_pair",
                 "ingest.undecodable_image"):
        assert f"<h3>{code} " in page
    # a cap on the rows read: a few parts only, stated on the page
    page2, info2 = render(big_run, stats_rows=5000)
    assert info2["stat_parts"] == 5
    assert "read 5 of 100 parts (about 5000 of 100000 rows" in page2
    assert "cat_complexity: n=5000," in page2


def test_report_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("RUN_DIR".lower(), "--out", "--sample", "--seed", "--stats-rows"):
        assert opt in out
