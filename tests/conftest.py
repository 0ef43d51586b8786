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
    """One local Ray for the whole test session (ray.init takes ~2 s), with one logical GPU:
    stages asking for GPUs get scheduled (with no device they run on the CPU)."""
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3():
    """A real S3 HTTP API (moto's server) on a free loopback port, for the whole session; the
    AWS environment points at it. ``s3.bucket()`` makes a fresh bucket and returns its URI."""
    pytest.importorskip("moto")
    from vlcurate.foundation import storage
    from tests.s3server import s3_server
    with s3_server() as server:
        storage.forget_clients()
        yield server
    storage.forget_clients()


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


NO_GPU = pytest.mark.skipif(not _cuda(), reason="no CUDA GPU here: the GPU path runs where one is")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=NO_GPU)])
def device(request) -> str:
    """The torch device of a test that must hold on the CPU and on a GPU (same code, a device
    argument); the cuda case runs where torch sees a GPU (CI has none: it is skipped there)."""
    return request.param


@pytest.fixture
def cuda() -> str:
    """A test comparing the GPU against the CPU: skipped without a GPU."""
    if not _cuda():
        pytest.skip("no CUDA GPU here: the GPU path runs where one is")
    return "cuda"
