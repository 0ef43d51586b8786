"""Shared fixtures. Real-data tests use ../shared/data and skip when it is absent."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from tests.paths import REPO, SHARED_DATA  # noqa: E402,F401  (one rule for tests and benchmarks)


def shared_data(sub: str) -> Path:
    p = SHARED_DATA / sub
    if not p.exists():
        pytest.skip(f"real data not available: {p}")
    return p


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole test session (ray.init takes ~2 s)."""
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()
