"""The Ray executor: one Ray Data chain per stage, read (tasks) -> stage -> write (tasks).

A stage with ``on_actors`` runs as a callable class on an actor pool (its models load once per
actor); any other runs in tasks with equal resources, which Ray Data fuses with the read and the
write into one task. Every Ray batch is one work item (a whole number of chunks of one part, or
for a stage that ``spans_parts`` one chunk over several parts): the read packs an item's table
into one row (``tasks.pack``) and every operator is Ray Data's public ``map_batches`` with
``batch_size=1``, which Ray accepts with GPUs too, so no batch cuts a chunk or joins two items
whatever Ray's block sizes.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

from vlcurate.foundation.params import Resources
from ..parts import Committer
from . import Work
from .tasks import StageActor, apply, read_batch, stage_task, write_batch


class RayExecutor:
    name = "ray"

    def __init__(self, rc: Any, threads: int = 1) -> None:
        from ..ray_env import init_ray
        self.ray, self.threads = init_ray(rc), threads
        import ray.data
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = rc.ray_progress_bars
        ctx.print_on_execution_start = False
        ctx.verbose_stats_logs = False
        if not rc.ray_progress_bars:
            logging.getLogger("ray.data").setLevel(logging.ERROR)

    def parts(self, w: Work, committer: Committer) -> None:
        if not w.items:                 # only empty parts pending: the driver commits them
            return
        items = [{"ranges": json.dumps(item), "spec": json.dumps(w.specs[item[0][0]]) if w.specs
                  else ""} for item in w.items]      # specs: a source's items are one range
        ds = self.ray.data.from_items(items, override_num_blocks=len(items))
        for b in self._chain(ds, w).iter_batches(batch_size=None, batch_format="pyarrow"):
            for rec in b.column("record").to_pylist():
                committer.add(rec)

    def _chain(self, ds: Any, w: Work) -> Any:
        """read -> stage -> write: the one operator chain, for tasks and actor pools alike."""
        res = w.res
        stage_cpus = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus or None}
        # beside a pool, reading and writing are light tasks; fused, they share the stage's
        io_cpus = {"num_cpus": 0.1} if w.stage.on_actors else stage_cpus
        kw = {"stage_cls": w.stage, "cfg": w.cfg, "state_uri": w.state_uri, "schema": w.schema,
              "workdir": w.workdir}
        ds = one_item(ds, read_batch, fn_kwargs={"io": w.io}, **io_cpus)
        if w.stage.on_actors:
            ds = one_item(ds, StageActor, fn_constructor_kwargs=kw,
                          compute=self._pool(res, len(w.items)), **stage_cpus)
        else:
            ds = one_item(ds, stage_task, fn_kwargs=kw, **stage_cpus)
        return one_item(ds, write_batch, fn_kwargs={"io": w.io}, **io_cpus)

    def _pool(self, res: Resources, n_items: int) -> Any:
        """A fixed pool of ``resources.concurrency`` actors, else one that starts with one
        actor and grows, up to one actor a part, as far as Ray Data's resource budget allows:
        the budget follows the cluster, so an autoscaling cluster's new nodes get actors too
        (and pending actors are what asks the cluster autoscaler for them)."""
        from ray.data import ActorPoolStrategy
        return (ActorPoolStrategy(size=res.concurrency) if res.concurrency
                else ActorPoolStrategy(min_size=1, max_size=max(1, n_items)))

    def call(self, fn: Callable, *args: Any, num_gpus: float = 0) -> Any:
        """A global step as one Ray task, with the stage's GPUs (a teacher model, an index)."""
        task = self.ray.remote(num_cpus=1, num_gpus=min(1.0, num_gpus) if num_gpus else 0)(fn)
        return self.ray.get(task.remote(*args))

    def map(self, fn: Callable, items: list) -> list:
        task = self.ray.remote(num_cpus=1)(apply)
        return self.ray.get([task.remote(fn, x, self.threads) for x in items])


def one_item(ds: Any, fn: Any, **kw: Any) -> Any:
    """``ds.map_batches(fn)`` one row at a time: a row is one work item (packed), with or
    without GPUs (public map_batches wants an int batch size with GPUs)."""
    return ds.map_batches(fn, batch_size=1, batch_format="pyarrow", **kw)
