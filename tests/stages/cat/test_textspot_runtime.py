"""What runs rapidocr's models (``textspot.runtime``, ``textspot.precision``): OpenVINO against
onnxruntime on real photos, the config seam, the cache's namespace and determinism."""
from __future__ import annotations

import pytest
from vlcurate.stages.cat import textspot as T
from vlcurate.stages.cat import textspot_runtime as RT

from tests.stages.cat.test_textspot import coco_rows, decisions, png, render, scene_text_rows

needs_openvino = pytest.mark.skipif(not RT.openvino_version(), reason="openvino is not installed")
needs_bf16 = pytest.mark.skipif(not RT.openvino_version() or not RT.cpu_bf16(),
                                reason="openvino is not installed or this CPU has no bf16")


@pytest.fixture(scope="module")
def ort():
    return T.RapidOcrBackend(runtime="onnxruntime")


@pytest.fixture(scope="module")
def ov_f32():
    return T.RapidOcrBackend(runtime="openvino", precision="f32")


def same_lines(a, b):
    """The same lines in the same order, confidences equal to 1e-5 (f32 kernels differ in
    their last bits)."""
    return len(a) == len(b) and all(x.text == y.text and abs(x.conf - y.conf) < 1e-5
                                    for x, y in zip(a, b))


def test_without_openvino_auto_falls_back_and_openvino_says_what_to_install(monkeypatch):
    monkeypatch.setattr(RT, "openvino_version", lambda: "")      # as where it does not import
    assert RT.resolve("auto", "cpu") == "onnxruntime"
    assert RT.identity("auto", "cpu", "bf16") == "onnxruntime"
    with pytest.raises(T.BackendUnavailable, match="pip install openvino"):
        T.RapidOcrBackend(runtime="openvino")
    assert T.RapidOcrBackend(runtime="auto").runtime == "onnxruntime"
    # the run summary says so (the stage's notes), and not where onnxruntime was asked for
    from vlcurate.pipeline import config as C
    from vlcurate.stages.cat.textspot_stage import TextSpotStage
    assert TextSpotStage.notes(C.load(None, {})) == [
        "textspot: textspot.runtime=auto runs onnxruntime: openvino does not import here "
        "(`pip install openvino`: ~2x cheaper, the same lines)"]
    assert TextSpotStage.notes(C.load(None, {"textspot.runtime": "onnxruntime"})) == []


@needs_openvino
def test_openvino_replaces_every_session_and_auto_picks_it_on_a_cpu(ort, ov_f32):
    assert ov_f32.runtime == "openvino" and ort.runtime == "onnxruntime"
    ocr = ov_f32.ocr
    assert all(isinstance(s, RT.OvSession) and s.precision == "f32"
               for s in (ocr.text_det.infer, ocr.text_cls.infer, ocr.text_rec.session))
    assert not isinstance(ort.ocr.text_rec.session, RT.OvSession)
    assert RT.resolve("auto", "cpu") == "openvino" and RT.resolve("auto", "cuda") == "onnxruntime"
    assert RT.resolve("openvino", "cuda") == "onnxruntime"      # the GPU path stays onnxruntime
    with pytest.raises(ValueError, match="precision"):
        T.RapidOcrBackend(runtime="openvino", precision="int4")


@needs_bf16
def test_det_bf16_compiles_the_detector_alone_in_bf16_and_says_so():
    from vlcurate.pipeline import config as C
    with pytest.raises(ValueError, match="precision"):    # measured, not offered: the config
        C.load(None, {"textspot.precision": "det-bf16"})  # refuses it
    ocr = T.RapidOcrBackend(runtime="openvino", precision="det-bf16").ocr
    # the precisions read back from the compiled models
    assert [s.precision for s in (ocr.text_det.infer, ocr.text_cls.infer,
                                  ocr.text_rec.session)] == ["bf16", "f32", "f32"]
    assert RT.identity("auto", "cpu", "det-bf16").endswith(" det-bf16")


def test_without_bf16_on_the_cpu_every_precision_runs_and_reads_as_f32(monkeypatch):
    monkeypatch.setattr(RT, "cpu_bf16", lambda: False)          # as on a CPU without AMX
    monkeypatch.setattr(RT, "openvino_version", lambda: "2099.1")
    for precision in RT.PRECISIONS:
        assert RT.plan(precision) == ("f32",) * 3
        assert RT.identity("openvino", "cpu", precision) == "openvino 2099.1 f32"
    with pytest.raises(ValueError, match="precision"):
        RT.plan("int4")
    from vlcurate.pipeline import config as C
    from vlcurate.stages.cat.textspot_stage import TextSpotStage
    assert TextSpotStage.notes(C.load(None, {"textspot.precision": "bf16"})) == [
        "textspot: textspot.precision=bf16 runs f32: this CPU has no bf16 (AMX or AVX512-BF16)"]
    assert TextSpotStage.notes(C.load(None, {})) == []             # f32 asked, f32 runs


def rule(lines, rows):
    return [T.text_spotted(T.best_match(x, c, 0.8), 5) for x, (_, c) in zip(lines, rows)]


@needs_openvino
@pytest.mark.realdata
def test_full_ocr_on_openvino_f32_reads_the_scene_text_photos_as_onnxruntime(ort, ov_f32):
    rows = scene_text_rows()
    a, b = (T.spot_all(ocr, [b for b, _ in rows], 1024)[0] for ocr in (ort, ov_f32))
    assert all(same_lines(x, y) for x, y in zip(a, b))
    assert sum(len(x) for x in a) >= 50                          # the photos hold many lines
    assert rule(a, rows) == rule(b, rows) and sum(rule(a, rows)) >= 8


@needs_openvino
@pytest.mark.realdata
def test_cascade_and_bf16_on_openvino_decide_coco_photos_as_the_full_ocr_on_onnxruntime(ort):
    from vlcurate.stages.cat.textspot_stage import TextSpotParams
    # 3 photos, and 2 whose caption repeats small text ("Serta", "anywhere!")
    rows = coco_rows(2) + coco_rows(names={"000000379349.jpg", "000000553664.jpg"})
    ref = decisions(ort, rows)
    assert sum(ref) >= 2
    for mode, precision in (("cascade", "f32"), ("full", "bf16")):
        ocr = T.RapidOcrBackend(fast=T.fast_path(TextSpotParams(mode=mode)), runtime="openvino",
                                precision=precision)
        assert decisions(ocr, rows) == ref, (mode, precision)


def card(text):
    """Rendered text on a card about as large as the full OCR's detector input (736 px high)."""
    return render(text, size=(300, 240))


@needs_openvino
@pytest.mark.parametrize("precision", ["f32", "bf16"])
def test_openvino_output_bytes_do_not_depend_on_the_batch_or_what_ran_before(precision):
    from vlcurate.stages.cat.textspot_stage import TextSpotParams
    ims = [card("COFFEE"), card(""), card("Hello")]
    fast = T.fast_path(TextSpotParams(mode="cascade"))
    first, again = (T.RapidOcrBackend(fast=fast, runtime="openvino", precision=precision)
                    for _ in range(2))
    whole = first(ims)
    assert whole[0] and whole[2] and not whole[1]
    assert [again([im])[0] for im in reversed(ims)] == whole[::-1]   # one by one, other order
    assert first(ims[1:] + ims[:1]) == whole[1:] + whole[:1]          # the same, rerun


@needs_openvino
def test_runtime_key_reaches_the_stage_and_its_cache_namespace(tmp_path):
    """textspot.runtime / precision in the config select the sessions the stage runs, and each
    (runtime, precision) reads into its own cache entries; the flags stay the full OCR's."""
    import pyarrow as pa
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.runner import build_stage
    from vlcurate.schemas import F
    from vlcurate.stages.cat.textspot_stage import TextSpotParams, TextSpotStage, _cache_key
    from vlcurate.stages.ingest.stage import image_hash

    def stage(yaml=None, **keys):
        return build_stage(TextSpotStage, C.load(yaml, {
            **{f"textspot.{k}": v for k, v in keys.items()}, "textspot.mode": "full",
            "run.progress": False, "run.image_cache": False}))
    ims = [png(card("")), png(card("COFFEE"))]
    batch = pa.table({F.SAMPLE_ID.name: ["a", "b"], F.CAPTION.name: ["coffee", "coffee"],
                      F.IMAGE.name: pa.array(ims, pa.binary()),
                      F.IMAGE_HASH.name: [image_hash(b) for b in ims]})
    (tmp_path / "c.yaml").write_text("textspot:\n  runtime: openvino\n  precision: bf16\n")
    ort, ov, auto = stage(runtime="onnxruntime"), stage(tmp_path / "c.yaml"), stage()
    assert ort.ocr.runtime == "onnxruntime" and ov.ocr.runtime == auto.ocr.runtime == "openvino"
    # the precision read back from the compiled model: bf16 where the CPU runs it
    assert ov.ocr.ocr.text_det.infer.precision == ("bf16" if RT.cpu_bf16() else "f32")
    assert auto.ocr.ocr.text_det.infer.precision == "f32"
    assert not isinstance(ort.ocr.ocr.text_det.infer, RT.OvSession)
    reasons = [s(batch).column(F.REASONS.name).to_pylist() for s in (ort, ov, auto)]
    assert reasons[0] == reasons[1] == reasons[2] and reasons[0][1]
    keys = {repr(_cache_key(TextSpotParams(runtime=r, precision=p)))
            for r, p in (("onnxruntime", "f32"), ("openvino", "f32"), ("openvino", "bf16"))}
    assert len(keys) == (3 if RT.cpu_bf16() else 2)     # without bf16 on the CPU, bf16 is f32
    assert (_cache_key(ov.config.textspot) != _cache_key(auto.config.textspot)) == RT.cpu_bf16()
    assert _cache_key(TextSpotParams()) == _cache_key(TextSpotParams(runtime="openvino"))
    assert _cache_key(TextSpotParams(runtime="onnxruntime", precision="bf16")) == \
        _cache_key(TextSpotParams(runtime="onnxruntime"))   # precision is OpenVINO's alone
