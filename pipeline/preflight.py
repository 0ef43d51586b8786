"""Preflight: what a run needs, checked on the driver before any stage runs, every problem at once.

``vlcurate check CONFIG`` prints the findings; ``vlcurate run`` runs the same checks first and stops
with exit code 2 when any fails, so that missing weights or a missing spaCy pipeline surface in
seconds, not after an hour of OCR. Each problem is one sentence that says what to do.

Only the stages in the run's DAG are checked, each through what it declares (``stages/base.py``):
the source's own checks first, then every stage's ``model_specs`` (*located* under the loading
policy, ``foundation.models.locate``, never loaded), each stage's ``preflight`` hook (the spaCy
pipeline, the OCR backend and WordNet are opened as the stages would open them; a stage that may
skip, ``if_missing: skip``, is reported, not failed), and the devices of ``model_specs`` and
``device_keys``. Nothing here names a stage.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Optional

from vlcurate.stages.base import Finding, Kind

from . import config as C

__all__ = ["Finding", "preflight", "problems", "format_findings", "check_models",
           "check_devices"]


def _stages(names: Iterable[str], dag: Optional[list] = None) -> list[type]:
    """The stage classes of ``dag`` (default: the default DAG) named in ``names``, in DAG order."""
    from .dag import default_dag
    wanted = set(names)
    return [n.stage for n in (default_dag() if dag is None else dag) if n.name in wanted]


def _spec(config: C.Config, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(config.section(section), name, None)


def check_models(config: C.Config, stages: list[type]) -> list[Finding]:
    from vlcurate.foundation import models
    out = []
    for key, family, kind in [m for stage in stages for m in stage.model_specs]:
        spec = _spec(config, key)
        if spec is None:                  # an optional model left out (embed.cross_model)
            continue
        if family == "backbone":
            family = "torchvision" if spec.id.startswith("torchvision/") else "timm"
        try:
            loc = models.locate(spec, family, kind)
        except models.ModelNotFound as e:
            out.append(Finding(False, f"{key}: {e}"))
            continue
        note = " (RANDOM weights: for tests only)" if loc.source == "random" else ""
        out.append(Finding(True, f"{key}: {spec.id} from {loc.source}{note}"))
    return out


def check_devices(config: C.Config, stages: list[type]) -> list[Finding]:
    """Every ``device: cuda`` of the run's stages (models, the mining matmuls) on a machine where
    torch sees no GPU: found here, not when a stage starts. On an embedded Ray only: a driver
    submitting to a cluster need not have the GPUs its stages get."""
    from vlcurate.foundation.models import DeviceUnavailable, resolve_device
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        return []           # the stages run on the cluster's nodes, not on this driver
    wanted = {f"{key}.device": spec.device for stage in stages for key, _, _ in stage.model_specs
              if (spec := _spec(config, key)) is not None}
    wanted.update({key: _spec(config, key) for stage in stages for key in stage.device_keys})
    out = []
    for key, value in wanted.items():
        try:
            resolve_device(value, key)
        except DeviceUnavailable as e:
            out.append(Finding(False, str(e)))
    return out


def preflight(config: C.Config, stages: Iterable[str], dag: Optional[list] = None) -> list[Finding]:
    """Every finding for the stages named in ``stages`` of ``dag`` (default: the default DAG)."""
    names = frozenset(stages)
    chosen = _stages(names, dag)
    sources = [s for s in chosen if s.kind == Kind.SOURCE]
    others = [s for s in chosen if s.kind != Kind.SOURCE]
    return ([f for s in sources for f in s.preflight(config, names)]
            + check_models(config, chosen)
            + [f for s in others for f in s.preflight(config, names)]
            + check_devices(config, chosen))


def problems(findings: list[Finding]) -> list[str]:
    return [f.text for f in findings if not f.ok]


def format_findings(findings: list[Finding]) -> str:
    bad = problems(findings)
    lines = [("ok       " if f.ok else "PROBLEM  ") + f.text for f in findings]
    tail = (f"{len(bad)} problem(s): fix them and rerun (nothing has run yet)" if bad
            else "preflight: everything this run needs is here")
    return "\n".join(lines + [tail])
