"""``vlcurate finetune``: launch the trainer (stages/finetune/) under torchrun.

The launcher resolves the config (from a YAML config, or from a run dir's run.json), then runs
``torchrun --nproc_per_node N -m vlcurate.pipeline.finetune --resolved JSON``; each process
initialises the process group (gloo on CPU, nccl on GPU) and calls ``train``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from . import config as C


def resolve(cfg: C.Config) -> tuple[C.FinetuneConfig, str, str]:
    ft = cfg.finetune
    run_dir = Path(cfg.run.run_dir)
    shards = ft.shards or str(Path(cfg.export.out_dir or run_dir / "export") / "shards")
    out = ft.out_dir or str(run_dir / "finetune")
    return concept_heads(ft, run_dir), str(Path(shards).resolve()), str(Path(out).resolve())


def concept_heads(ft: C.FinetuneConfig, run_dir: Path) -> C.FinetuneConfig:
    """With ``concept_weight > 0``, a head size left at 0 is the number of concepts of that kind
    in the run's vocabulary (``<run>/concepts/vocab.parquet``), so the heads fit the targets."""
    if not ft.concept_weight or (ft.n_objects and ft.n_attributes):
        return ft
    from vlcurate.schemas import concepts as CO
    path = run_dir / "concepts" / "vocab.parquet"
    if not path.exists():
        raise FileNotFoundError(f"finetune.concept_weight > 0: no concept vocabulary at {path}; "
                                "run the concepts stage, or set finetune.n_objects/n_attributes")
    import pyarrow.parquet as pq
    kinds = pq.read_table(path, columns=[CO.V_KIND.name]).column(0).to_pylist()
    return dataclasses.replace(ft, n_objects=ft.n_objects or kinds.count("object"),
                               n_attributes=ft.n_attributes or kinds.count("attribute"))


def launch(cfg: C.Config, nproc: Optional[int] = None) -> int:
    from vlcurate.stages.finetune.data import ShardSet
    from vlcurate.stages.finetune.train import check_config
    try:        # a config the shards cannot serve stops here, with its reason, before torchrun
        ft, shards, out = resolve(cfg)
        check_config(ft, ShardSet(shards))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = nproc or ft.nproc
    payload = json.dumps({"finetune": C.to_dict(ft), "shards": shards, "out": out})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
           "-m", "vlcurate.pipeline.finetune", "--resolved", payload]
    print(f"finetune: {n} process(es), shards {shards} -> {out}")
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def worker(payload: str) -> int:
    import torch
    import torch.distributed as dist

    from vlcurate.stages.finetune.train import train
    data = json.loads(payload)
    ft = C.from_dict({"finetune": data["finetune"]}).finetune
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() and ft.model.device != "cpu"
                                else "gloo")
    try:
        rank = dist.get_rank() if world > 1 else 0
        train(ft, data["shards"], data["out"], log=(print if rank == 0 else (lambda *_: None)))
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vlcurate.pipeline.finetune")
    ap.add_argument("--resolved", required=True)
    return worker(ap.parse_args(argv).resolved)


if __name__ == "__main__":
    sys.exit(main())
