"""Connecting to Ray: a cluster from ``ray.address`` or $RAY_ADDRESS, else an embedded local one."""
from __future__ import annotations

import logging
import os
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def init_ray(rc: Any) -> Any:
    import ray

    if ray.is_initialized():
        return ray
    address = rc.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    else:
        ray.init(num_cpus=rc.num_cpus, num_gpus=rc.num_gpus, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=True,
                 configure_logging=True)
    return ray
