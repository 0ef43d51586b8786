"""foundation/heap.py: nested malloc settings restore the enclosing block's, never glibc's 128 KB
defaults (which made later stages' bf16 casts 3x slower), and stay out of the user's way."""
from __future__ import annotations

import pytest
from vlcurate.foundation import heap
from vlcurate.stages.mining.engine import core


class Recorder:
    """Stands in for the C library only: records what would be set, to read the order back."""

    def __init__(self):
        self.state, self.trims = {}, 0

    def mallopt(self, option, value):
        self.state[option] = value
        return 1

    def malloc_trim(self, pad):
        self.trims += 1
        return 1


@pytest.fixture
def libc(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(heap, "glibc", lambda: rec)
    return rec


def test_a_mining_block_inside_a_global_step_gives_the_step_its_settings_back(libc):
    step = {**heap.SETTLED, heap.M_MMAP_THRESHOLD: heap.HEAP_MMAP_BYTES,
            heap.M_TRIM_THRESHOLD: heap.GLIBC_DEFAULT}
    with heap.bounded_heap():
        assert libc.state == step
        with core.freed_memory_kept():
            assert libc.state[heap.M_MMAP_THRESHOLD] == 32 << 20
            assert libc.state[heap.M_TOP_PAD] == 64 << 20
        assert libc.state == step and libc.trims == 1
    assert libc.state == heap.SETTLED
    with core.freed_memory_kept():               # alone, e.g. an in-process stage or an actor
        pass
    assert libc.state == heap.SETTLED and libc.trims == 2
    assert heap._STACK == [heap.SETTLED]


def test_an_exception_inside_still_restores(libc):
    with pytest.raises(ValueError), heap.bounded_heap():
        with core.freed_memory_kept():
            raise ValueError("a stage failed")
    assert libc.state == heap.SETTLED and heap._STACK == [heap.SETTLED]


def test_the_users_malloc_variables_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    heap.glibc.cache_clear()
    try:
        assert heap.glibc() is None
        with heap.bounded_heap(), core.freed_memory_kept():
            assert heap._STACK == [heap.SETTLED]            # nothing pushed, nothing set
    finally:
        monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
        heap.glibc.cache_clear()
    assert heap.glibc() is not None                          # the tests run on glibc
