"""What runs rapidocr's three ONNX models (detector, angle classifier, recogniser):
``textspot.runtime``.

* ``onnxruntime``: rapidocr's own sessions (the GPU path, ``textspot.device=cuda``, is always this);
* ``openvino``: the same ONNX files compiled by OpenVINO for the CPU, at ``textspot.precision``
  (``f32``: the full OCR's lines, ~2x cheaper; ``bf16``: all three models in bf16). bf16 runs
  where the CPU has it (AMX or AVX512-BF16); elsewhere OpenVINO runs f32, and the identity says
  so. ``det-bf16`` (the detector alone in bf16) is for ``bench_textspot.py``: it changes product-
  pack decisions, so the stage does not offer it;
* ``auto``: ``openvino`` on a CPU when it imports, else ``onnxruntime``.

Only the session changes: ``use_openvino`` puts an ``OvSession`` in place of each of rapidocr's
``OrtInferSession`` objects, so rapidocr's own pipeline (``mode=full``) and the fast path and
cascade run their pre- and post-processing, padding and rules unchanged. One thread per session
(``threads``) keeps a model's output bytes independent of the batch and of what ran before.
The detector's upsampling head is compiled in a form OpenVINO fuses (``textspot_graph``), used
where its maps are the original's to the bit: ~16% cheaper, the same bytes.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

RUNTIMES = ("auto", "onnxruntime", "openvino")
PRECISIONS = ("f32", "bf16", "det-bf16")


class BackendUnavailable(RuntimeError):
    """The OCR backend cannot run here; the message says what to install or change."""


# each precision's per-model precisions (detector, angle classifier, recogniser)
PLANS = {"f32": ("f32",) * 3, "bf16": ("bf16",) * 3, "det-bf16": ("bf16", "f32", "f32")}


@functools.cache
def openvino_version() -> str:
    """The installed OpenVINO's version, or '' when it does not import."""
    try:
        import openvino
    except Exception:  # noqa: BLE001 - a broken install reads as absent
        return ""
    return str(openvino.__version__ if hasattr(openvino, "__version__")
               else openvino.get_version())


def resolve(runtime: str, device: str) -> str:
    """``textspot.runtime`` as it will run: ``onnxruntime`` or ``openvino``."""
    if runtime not in RUNTIMES:
        raise ValueError(f"textspot.runtime={runtime!r}: unknown (known: {list(RUNTIMES)})")
    if device == "cuda" or runtime == "onnxruntime":
        return "onnxruntime"
    if runtime == "auto":
        return "openvino" if openvino_version() else "onnxruntime"
    return "openvino"


@functools.cache
def cpu_bf16() -> bool:
    """Does OpenVINO run bf16 on this CPU (AMX or AVX512-BF16)? Elsewhere a bf16 hint runs f32."""
    import openvino
    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def plan(precision: str) -> tuple[str, ...]:
    """``textspot.precision`` as it runs on this CPU: the detector's, classifier's and
    recogniser's precisions (f32 for all where the CPU has no bf16)."""
    if precision not in PRECISIONS:
        raise ValueError(f"textspot.precision={precision!r}: unknown (known: "
                         f"{list(PRECISIONS)})")
    return PLANS[precision] if openvino_version() and cpu_bf16() else PLANS["f32"]


def effective(precision: str) -> str:
    """The name of the precision that really runs here (``f32`` where bf16 would not)."""
    return next(k for k, v in PLANS.items() if v == plan(precision))


def identity(runtime: str, device: str, precision: str) -> str:
    """The runtime as it will run, with its version and (OpenVINO) precision as it runs on
    this CPU: what a model's output bytes depend on beyond the models (no model is loaded)."""
    if resolve(runtime, device) == "onnxruntime":
        return "onnxruntime"
    if not openvino_version():
        return f"openvino missing {precision}"
    return f"openvino {openvino_version()} {effective(precision)}"


def fallbacks(runtime: str, device: str, precision: str) -> list[str]:
    """What runs here other than what the config names, in words for the run summary: ``auto``
    on onnxruntime because openvino does not import, or bf16 run as f32 on a CPU without it."""
    ran = resolve(runtime, device)
    if ran == "onnxruntime" and runtime == "auto" and device != "cuda":
        return ["textspot.runtime=auto runs onnxruntime: openvino does not import here "
                "(`pip install openvino`: ~2x cheaper, the same lines)"]
    if ran == "openvino" and openvino_version() and effective(precision) != precision:
        return [f"textspot.precision={precision} runs {effective(precision)}: this CPU has no "
                "bf16 (AMX or AVX512-BF16)"]
    return []


class OvSession:
    """One ONNX model compiled by OpenVINO for the CPU at ``precision`` (f32 or bf16), called as
    rapidocr calls its ``OrtInferSession``: ``session(x)`` -> [first output] (every model here
    has one); ``.precision`` is what the compiled model runs. ``rewrite`` (optional) edits the
    graph in place and says whether it did (``textspot_graph.fold_head``); the edited model
    replaces the file's only when their outputs are equal to the bit on ``CHECK_SHAPES``
    (``.rewritten``; checked once per process and settings: ``compile_checked``), so it can
    change the speed, never the output."""

    def __init__(self, core: Any, model_path: str, threads: int, precision: str,
                 rewrite: Optional[Callable[[Any], bool]] = None) -> None:
        props = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY"}
        if threads > 0:
            props["INFERENCE_NUM_THREADS"] = threads
        self.model, self.rewritten = compile_checked(core, model_path, props, rewrite)
        self.request = self.model.create_infer_request()
        self.out = self.model.output(0)
        self.path = model_path
        # what runs, read back from the compiled model ('f32' or 'bf16')
        self.precision = self.model.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    def __call__(self, x: Any) -> list:
        return [self.request.infer({0: x})[self.out].copy()]


# per process: (model file, rewrite, compile settings) -> did the rewritten model's outputs
# equal the file's (the check compiles both once)
CHECKED: dict[tuple, bool] = {}


def compile_checked(core: Any, path: str, props: dict,
                    rewrite: Optional[Callable[[Any], bool]]) -> tuple[Any, bool]:
    """The compiled model, and whether it is ``rewrite``'s edit of the file's: the edit where it
    applies and its outputs equal the file's to the bit (``same_outputs``), else the file's."""
    edited = core.read_model(path) if rewrite else None
    if edited is None or not rewrite(edited):
        return core.compile_model(path, "CPU", props), False
    key = (path, rewrite.__qualname__, tuple(sorted(props.items())))
    if key not in CHECKED:
        plain, fast = (core.compile_model(m, "CPU", props) for m in (path, edited))
        CHECKED[key] = same_outputs(plain, fast)
        return (fast, True) if CHECKED[key] else (plain, False)
    return core.compile_model(edited if CHECKED[key] else path, "CPU", props), CHECKED[key]


# the inputs on which a rewritten model must match the original to the bit (seeded, uniform in
# the detector's normalised range): both orientations and a size not a multiple of 64
CHECK_SHAPES = ((1, 3, 96, 160), (1, 3, 224, 96))


def same_outputs(a: Any, b: Any) -> bool:
    """Do the compiled models ``a`` and ``b`` give the same output bytes on ``CHECK_SHAPES``?"""
    import numpy as np
    rng = np.random.default_rng(0)
    ra, rb = a.create_infer_request(), b.create_infer_request()
    for shape in CHECK_SHAPES:
        x = rng.uniform(-2.2, 2.7, shape).astype(np.float32)
        if not np.array_equal(ra.infer({0: x})[a.output(0)], rb.infer({0: x})[b.output(0)]):
            return False
    return True


def use_openvino(ocr: Any, threads: int, precision: str) -> None:
    """Put OpenVINO sessions of the same model files, each at its precision in ``plan``, in
    place of ``ocr``'s (a ``RapidOCR``) onnxruntime sessions; the recogniser keeps the character
    list it read at start."""
    if not openvino_version():
        raise BackendUnavailable("textspot.runtime=openvino: cannot import openvino; `pip "
                                 "install openvino` or textspot.runtime=onnxruntime")
    import openvino
    core = openvino.Core()
    from .textspot_graph import fold_head
    for (model, attr, rewrite), each in zip(((ocr.text_det, "infer", fold_head),
                                             (ocr.text_cls, "infer", None),
                                             (ocr.text_rec, "session", None)), plan(precision)):
        path = str(getattr(model, attr).session._model_path)
        setattr(model, attr, OvSession(core, path, threads, each, rewrite))
