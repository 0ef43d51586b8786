"""``vlcurate``: run, demo, inspect, report and export."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

from vlcurate.foundation import storage

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
RUN_DIR_HELP = "a run directory: a folder, or a URI (s3://bucket/prefix, gs://...)"

EXAMPLES = """examples:
  vlcurate demo                                  # render a demo dataset and run the DAG on it
  vlcurate check config.yaml                     # preflight: weights, spaCy, OCR, WordNet, source
  vlcurate run config.yaml --set source.path=/data/pairs --set run.run_dir=runs/a
  vlcurate inspect runs/a                        # counts, reject reasons with examples, schemas
  vlcurate report runs/a --out runs/a.html       # one static HTML page: funnel, histograms, grids
  vlcurate export runs/a --set 'export.drop=[ingest.*]' --out runs/a/export-loose
  vlcurate finetune runs/a --nproc 2 --set finetune.loss=helip --set finetune.steps=500
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set ingest.max_pixels=50000000 (YAML value)")
    p.add_argument("--executor", choices=["ray", "local"], default="ray",
                   help="ray (default): Ray Data on $RAY_ADDRESS or an embedded local Ray; "
                        "local: the same stages in this process, no Ray")


def _preflight(config, verbose: bool = False) -> int:
    """Every problem the run would meet, at once, before anything runs (0 ok, 2 problems)."""
    from .dag import default_dag, select
    from .preflight import format_findings, preflight, problems
    findings = preflight(config, [n.name for n in select(default_dag(), config.run.stages)])
    bad = problems(findings)
    if bad or verbose:
        print(format_findings(findings) if verbose else
              "preflight found problems; nothing has run yet:\n" + "\n".join(f"  - {b}" for b in bad),
              file=sys.stderr if bad else sys.stdout)
    return 2 if bad else 0


def _run(config, executor: str, only=None) -> int:
    from .runner import RunError, run
    from .summary import format_summary, problems
    if only is None and _preflight(config):
        return 2
    try:
        results = run(config, executor=executor, only=only)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_summary(results))
    for r in results:
        if r.info.get("shards") is not None:
            root = config.export.out_dir or storage.join(config.run.run_dir, "export")
            print(f"\n{r.info['samples']} samples in {r.info['shards']} WebDataset shards: "
                  f"{storage.redact(storage.join(root, 'shards'))}\nannotated Parquet: "
                  f"{storage.redact(storage.join(root, 'data'))}\n"
                  f"inspect: vlcurate inspect {storage.redact(config.run.run_dir)}")
    if problems(results):
        return 1
    return _empty(config, results)


def _empty(config, results) -> int:
    """A run that exported no row: the reasons and their settings, and exit code 2 unless
    ``run.allow_empty``."""
    from vlcurate.schemas import F
    from .guards import empty_export
    why = empty_export([r.manifest for r in results], config.export.drop)
    if why is None:
        return 0
    print(f"\n{why}")
    n = results[0].manifest[F.MK.ROWS]
    if config.run.allow_empty:
        print(f"\nthe run exported none of its {n} rows (run.allow_empty is true)")
        return 0
    print(f"error: the run exported none of its {n} rows (the summary and the reasons above "
          "say why); change the settings named there, or set run.allow_empty: true to accept an "
          "empty result", file=sys.stderr)
    return 2


def _limited(config: Any, limit: Optional[int]) -> Any:
    """``--limit N``: at most the first N records of each source (``source.limit``)."""
    if limit is None:
        return config
    from vlcurate.foundation.params import to_dict
    src = to_dict(config.source)
    also = [dict(s, limit=limit) for s in src["also"]]
    return config.replace(source=dict(src, limit=limit, also=also))


def cmd_run(a: argparse.Namespace) -> int:
    from . import config as C
    return _run(_limited(C.load(a.config, a.overrides), a.limit), a.executor)


def cmd_check(a: argparse.Namespace) -> int:
    from . import config as C
    return _preflight(C.load(a.config, a.overrides), verbose=True)


def cmd_demo(a: argparse.Namespace) -> int:
    from . import config as C
    from .demo import demo_overrides, make_demo
    out = Path(a.out)
    data = make_demo(out / "data", n=a.n)
    print(f"demo dataset: {data} ({a.n} rendered pairs + near-duplicates + broken records)")
    overrides = {**demo_overrides(data, out / "run"), **C.parse_overrides(a.overrides)}
    return _run(C.load(a.config, overrides), a.executor)


def _run_dir_config(run_dir: str, given: str, overrides: list[str]) -> Optional[Any]:
    """The config a run directory ran with (its run.json), with ``run.run_dir`` = ``given`` (the
    directory as given here: run.json records it redacted, no credentials in it) and the
    overrides; None, with the reason printed, when it is no run directory."""
    from . import config as C
    run_json = storage.read_json(storage.join(run_dir, "run.json"))
    if run_json is None:
        print(f"error: {storage.redact(run_dir)} is not a vlcurate run directory (no run.json)",
              file=sys.stderr)
        return None
    return C.from_snapshot(run_json["config"]).replace(
        **{"run.run_dir": given, **C.parse_overrides(overrides)})


def _local_or_uri(path: str) -> str:
    return str(Path(path).resolve()) if storage.is_local(path) else path


def cmd_export(a: argparse.Namespace) -> int:
    cfg = _run_dir_config(a.run_dir, a.run_dir, a.overrides)
    if cfg is None:
        return 2
    if a.out:
        cfg = cfg.replace(**{"export.out_dir": _local_or_uri(a.out)})
    return _run(cfg, a.executor, only={"export"})


def cmd_finetune(a: argparse.Namespace) -> int:
    from . import config as C
    from .finetune import launch
    target = a.target          # a run directory (a path or URI: s3://, gs://) or a config file
    if storage.is_local(target) and not Path(target).is_dir():
        return launch(C.load(target, a.overrides), a.nproc)
    cfg = _run_dir_config(target, _local_or_uri(target), a.overrides)
    return 2 if cfg is None else launch(cfg, a.nproc)


def cmd_inspect(a: argparse.Namespace) -> int:
    from .inspect import inspect_run
    print(inspect_run(a.run_dir, examples=a.examples, rows=a.rows, export_dir=a.export))
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from .report import ReportError, write_report
    try:
        path, info = write_report(a.run_dir, a.out, sample=a.sample, seed=a.seed,
                                  stats_rows=a.stats_rows)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    absent = f"; not in this run: {', '.join(info['absent'])}" if info["absent"] else ""
    print(f"report: {storage.redact(str(path))} ({info['bytes'] / 1e3:.0f} kB, "
          f"{info['seconds']:.1f}s){absent}")
    return 0


def user_error(err: Optional[BaseException]) -> Optional[BaseException]:
    """The user's mistake in ``err`` (a config, source or device error, or the ``DataError`` a
    stage raised), unwrapped from Ray's errors when a worker raised it; None for anything else."""
    from vlcurate.foundation.params import ConfigError
    from vlcurate.stages.ingest import SourceError
    from vlcurate.foundation.models import DeviceUnavailable
    ray_errors = sys.modules.get("ray.exceptions")
    wrapper = ray_errors.RayError if ray_errors else ()
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (ConfigError, SourceError, DeviceUnavailable)) and \
                not isinstance(err, wrapper):
            return err
        err = getattr(err, "cause", None) or err.__cause__
    return None


def _add_run(sub: Any) -> None:
    r = sub.add_parser("run", help="run the DAG from a YAML config (resumes where it stopped)")
    r.add_argument("config", help="YAML config (values only; see docs/config.md)")
    r.add_argument("--limit", type=int, default=None, metavar="N",
                   help="a quick trial: only the first N records of each source (source.limit)")
    _common(r)
    r.set_defaults(fn=cmd_run)


def _add_check(sub: Any) -> None:
    c = sub.add_parser("check", help="preflight: check the weights, spaCy pipeline, OCR backend, "
                       "WordNet and source a run needs, all at once, without running anything")
    c.add_argument("config", help="YAML config")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.set_defaults(fn=cmd_check)


def _add_demo(sub: Any) -> None:
    d = sub.add_parser("demo", help="render a small demo dataset and run the whole DAG locally")
    d.add_argument("--out", default="runs/demo", help="folder for the demo data and run (runs/demo)")
    d.add_argument("--n", type=int, default=200, help="rendered pairs (200)")
    d.add_argument("--config", default=None, help="optional YAML config layered under the demo's")
    _common(d)
    d.set_defaults(fn=cmd_demo)


def _add_inspect(sub: Any) -> None:
    i = sub.add_parser("inspect", help="per-stage counts, reject reasons with examples, schemas")
    i.add_argument("run_dir", help=RUN_DIR_HELP)
    i.add_argument("--examples", type=int, default=3, help="examples per reject reason (3)")
    i.add_argument("--rows", type=int, default=5, help="rows of the annotated table to show (5)")
    i.add_argument("--export", default=None, metavar="DIR",
                   help="show this export (a `vlcurate export --out DIR`) instead of the run's own")
    i.set_defaults(fn=cmd_inspect)


def _add_report(sub: Any) -> None:
    rp = sub.add_parser("report", help="write a static HTML report: funnel, histograms, image grids "
                        "of hard pairs, rejects by reason, recaptions")
    rp.add_argument("run_dir", help=RUN_DIR_HELP)
    rp.add_argument("--out", default=None, help="HTML file to write (RUN_DIR/report.html)")
    rp.add_argument("--sample", type=int, default=8, help="random targets / rows per section (8)")
    rp.add_argument("--seed", type=int, default=0, help="seed of every random choice (0)")
    rp.add_argument("--stats-rows", type=int, default=200_000,
                    help="histograms and samples read random whole parts up to this many rows")
    rp.set_defaults(fn=cmd_report)


def _add_export(sub: Any) -> None:
    e = sub.add_parser("export", help="re-export a finished run with another keep policy "
                       "(no stage is recomputed)")
    e.add_argument("run_dir", help=RUN_DIR_HELP)
    e.add_argument("--out", default=None, help="write this export here instead of RUN_DIR/export")
    _common(e)
    e.set_defaults(fn=cmd_export)


def _add_finetune(sub: Any) -> None:
    f = sub.add_parser("finetune", help="fine-tune a CLIP model on a run's shards (torchrun DDP)")
    f.add_argument("target", help="a run directory (uses its config) or a YAML config")
    f.add_argument("--nproc", type=int, default=None, help="processes (default finetune.nproc)")
    f.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    f.set_defaults(fn=cmd_finetune)


COMMANDS = (_add_run, _add_check, _add_demo, _add_inspect, _add_report, _add_export,
            _add_finetune)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vlcurate", description="Curate image-text pairs for "
                                "CLIP-style training on Ray Data.", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    a = parser().parse_args(argv)
    try:
        return a.fn(a)
    except Exception as err:           # a user's mistake is one line; anything else, a traceback
        mistake = user_error(err)
        if mistake is None:
            raise
        print(f"error: {' '.join(str(mistake).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: committed parts are kept; rerun the same command to resume",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
