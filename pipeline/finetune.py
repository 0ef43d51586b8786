"""``vlcurate finetune``: launch the trainer (trainer/) under torchrun.

The launcher resolves the config (from a YAML config, or from a run dir's run.json), checks it
against the shards and the out_dir, then runs ``python -m vlcurate.pipeline.finetune --nproc N``,
which runs torchrun quietly (``torchrun``) over ``-m vlcurate.pipeline.finetune --resolved JSON``;
each process initialises the process group (gloo on CPU, nccl on GPU) and calls ``train``. A
user error on any rank ends as one line from the launcher and exit code 2 (``report``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Optional

from . import config as C
from vlcurate.foundation import storage


def _user_errors() -> tuple[type, ...]:
    from vlcurate.foundation.models import ModelNotFound
    # ValueError covers MissingAnnotation, UnsafeCheckpoint, OutDirInUse and config values
    return (ValueError, FileNotFoundError, ModelNotFound)


USER_ERRORS = _user_errors()


def resolve(cfg: C.Config) -> tuple[C.FinetuneConfig, str, str]:
    """(config, shards, out_dir): paths or URIs (s3://, gs://, ...); a local path made absolute
    (the ranks may start elsewhere), a URI kept as given."""
    ft = cfg.finetune
    run_dir = str(cfg.run.run_dir)
    shards = ft.shards or storage.join(cfg.export.out_dir or storage.join(run_dir, "export"),
                                       "shards")
    out = ft.out_dir or storage.join(run_dir, "finetune")
    return concept_heads(ft, run_dir), _absolute(shards), _absolute(out)


def _absolute(uri: str) -> str:
    return str(Path(storage.local_path(uri)).resolve()) if storage.is_local(uri) else str(uri)


def concept_heads(ft: C.FinetuneConfig, run_dir: str) -> C.FinetuneConfig:
    """With ``concept_weight > 0``, a head size left at 0 is the number of concepts of that kind
    in the run's vocabulary (``<run>/concepts/vocab.parquet``), so the heads fit the targets."""
    if not ft.concept_weight or (ft.n_objects and ft.n_attributes):
        return ft
    from vlcurate.schemas import concepts as CO
    path = storage.join(str(run_dir), "concepts", "vocab.parquet")
    if not storage.exists(path):
        raise FileNotFoundError(f"finetune.concept_weight > 0: no concept vocabulary at "
                                f"{storage.redact(path)}; run the concepts stage, or set "
                                "finetune.n_objects/n_attributes")
    import pyarrow.parquet as pq
    fs, inner = storage.resolve(path)
    kinds = pq.read_table(inner, columns=[CO.V_KIND.name], filesystem=fs).column(0).to_pylist()
    return dataclasses.replace(ft, n_objects=ft.n_objects or kinds.count("object"),
                               n_attributes=ft.n_attributes or kinds.count("attribute"))


def launch(cfg: C.Config, nproc: Optional[int] = None) -> int:
    """Check on the driver, then torchrun. A failure a rank reports (``USER_ERRORS``) comes back
    as ONE line on stderr and exit code 2, whichever rank hit it (each rank writes its line to a
    file of a fresh folder; the launcher prints the lowest rank's)."""
    from vlcurate.trainer.data import ShardSet
    from vlcurate.trainer.outdir import check_out_dir
    from vlcurate.trainer.train import check_config, device_spec
    from vlcurate.foundation import models
    try:        # a config the shards cannot serve stops here, with its reason, before torchrun
        ft, shards, out = resolve(cfg)
        n = nproc or ft.nproc
        models.resolve_device(*device_spec(ft))
        check_config(ft, ShardSet(shards))
        check_out_dir(ft, shards, out, n, write=False)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="vlcurate-ft-") as errors:
        payload = json.dumps({"finetune": C.to_dict(ft), "shards": shards, "out": out,
                              "errors": errors})
        print(f"finetune: {n} process(es), shards {storage.redact(shards)} -> "
              f"{storage.redact(out)}")
        cmd = [sys.executable, "-m", "vlcurate.pipeline.finetune", "--nproc", str(n),
               "--resolved", payload]
        rc = subprocess.call(cmd, env={**os.environ,
                                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        reported = sorted(Path(errors).glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
        if reported:
            print(f"error: {reported[0].read_text().strip()}", file=sys.stderr)
            return 2
    return rc


def torchrun(n: int, payload: str) -> int:
    """torchrun in this process, quiet: its agent's logs and its ChildFailedError report would
    repeat every failing rank's story; the exit code of the first failure is returned instead."""
    import logging

    from torch.distributed import run as tr
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    args = tr.get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={n}", "-m", "vlcurate.pipeline.finetune",
         "--resolved", payload])
    try:
        tr.run(args)
    except ChildFailedError as e:
        return e.get_first_failure()[1].exitcode or 1
    return 0


def report(errors: Optional[str], out: str, rank: int, e: BaseException) -> None:
    """One line for the launcher (``<errors>/rank<r>.txt``); the traceback, for whoever needs
    it, in ``<out>/error-rank<r>.log``."""
    line = " ".join(str(e).split()) or type(e).__name__
    try:
        log = storage.join(out, f"error-rank{rank}.log")
        storage.write_bytes(log, "".join(traceback.format_exception(e)).encode())
        line += f" (traceback: {storage.redact(log)})"
    except OSError:
        pass
    if errors:
        Path(errors, f"rank{rank}.txt").write_text(line)
    else:
        print(f"error: {line}", file=sys.stderr)


def worker(payload: str) -> int:
    import torch.distributed as dist

    from vlcurate.foundation import models
    from vlcurate.trainer.train import device_spec, train
    data = json.loads(payload)
    ft = C.from_dict({"finetune": data["finetune"]}).finetune
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        cuda = models.resolve_device(*device_spec(ft)) == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    try:
        train(ft, data["shards"], data["out"], log=(print if rank == 0 else (lambda *_: None)))
    except USER_ERRORS as e:
        report(data.get("errors"), data["out"], rank, e)
        return 2
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vlcurate.pipeline.finetune")
    ap.add_argument("--resolved", required=True)
    ap.add_argument("--nproc", type=int, default=None, help="run torchrun with N ranks")
    a = ap.parse_args(argv)
    return torchrun(a.nproc, a.resolved) if a.nproc else worker(a.resolved)


if __name__ == "__main__":
    sys.exit(main())
