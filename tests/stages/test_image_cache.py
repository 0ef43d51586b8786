"""The content-addressed per-image cache (stages/cache.py): its store, and the real hand-off
through the runner: a second run over the same images with a changed text-spotting threshold
reads every OCR result from the cache and writes the same table an uncached run writes."""
from __future__ import annotations

import pyarrow.dataset as ds
import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.runner import run
from vlcurate.stages.cache import ImageCache, cached
from vlcurate.stages.cat import textspot as T
from vlcurate.stages.cat.textspot_stage import TextSpotStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from tests.pipeline.test_runner import quiet

H = [f"{i:032x}" for i in range(6)]


def _cache(root, **ns) -> ImageCache:
    return ImageCache(str(root), "s", ns or {"v": 1}, encode=list, decode=tuple)


def test_results_survive_into_a_new_instance_and_namespaces_are_apart(tmp_path):
    a = _cache(tmp_path)
    assert a.get(H) == {}
    a.put({H[0]: (1.5, "x"), H[3]: (0.1 + 0.2, "y")})
    a.put({H[5]: (7, "z")})
    b = _cache(tmp_path)
    assert b.get(H) == {H[0]: (1.5, "x"), H[3]: (0.1 + 0.2, "y"), H[5]: (7, "z")}  # exact floats
    assert (b.hits, b.misses) == (3, 3)
    assert _cache(tmp_path, v=2).get(H) == {}


def test_a_worker_reads_what_it_and_the_others_wrote_since_it_first_looked(tmp_path):
    """Parts on two actors (or one actor's next part): an image computed once anywhere in the
    run is read from then on, never computed again."""
    a, b = _cache(tmp_path), _cache(tmp_path)
    assert a.get(H[:2]) == {} and b.get(H[:2]) == {}          # both have looked: empty
    a.put({H[0]: (1,)})
    assert a.get(H[:1]) == {H[0]: (1,)}                         # its own write
    assert b.get(H[:2]) == {H[0]: (1,)}                         # the other's, written since
    b.put({H[1]: (2,)})
    b.put({H[0]: (1,)})                                         # the same answer, again
    assert a.get(H[:3]) == {H[0]: (1,), H[1]: (2,)}
    calls = []
    got = cached(b, H[:3], lambda todo: calls.extend(todo) or [(9,)] * len(todo))
    assert calls == [2] and got == [(1,), (2,), (9,)]          # only the new image computed


def test_the_same_results_make_the_same_segment_and_a_damaged_one_is_a_miss(tmp_path):
    a = _cache(tmp_path)
    a.put({H[1]: (1,), H[2]: (2,)})
    a.put({H[2]: (2,), H[1]: (1,)})
    segments = sorted(p for p in tmp_path.rglob("seg-*.parquet"))
    assert len(segments) == 1
    segments[0].write_bytes(b"not parquet")
    assert _cache(tmp_path).get(H) == {}


def test_cached_computes_only_what_the_cache_lacks_and_keeps_only_what_it_may(tmp_path):
    asked = []

    def compute(todo):
        asked.append(list(todo))
        return [(i, "ok") if i != 2 else (None, "failed") for i in todo]

    cache = ImageCache(str(tmp_path), "s", {}, encode=list, decode=tuple,
                       keep=lambda r: r[0] is not None)
    first = cached(cache, H[:4], compute)
    assert asked == [[0, 1, 2, 3]]
    again = cached(ImageCache(str(tmp_path), "s", {}, encode=list, decode=tuple), H[:5], compute)
    assert asked[1] == [2, 4]                      # the failure is tried again; 4 is new
    assert again[:2] == first[:2] and again[3] == first[3]
    assert cached(None, H[:2], compute) == [(0, "ok"), (1, "ok")]


# --- through the runner: textspot with its real OCR backend -----------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    pytest.importorskip("rapidocr_onnxruntime")
    return make_demo(tmp_path_factory.mktemp("demo") / "data", n=24)


def _dag():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(TextSpotStage, after=("ingest", "ids"))]


def _run(demo, run_dir, cache_dir, **sets):
    o = {**demo_overrides(demo, run_dir), "source.rows_per_part": 10, "run.cache_dir": cache_dir,
         **sets}
    run(C.load(None, o, dag=_dag()), dag=_dag(), executor="local", log=quiet)
    return ds.dataset(run_dir / "textspot" / "data", format="parquet").to_table()


def test_a_rerun_with_another_threshold_reads_every_image_from_the_cache(demo, tmp_path,
                                                                           monkeypatch):
    seen = []
    real = T.spot_all

    def counted(backend, images, max_side, captions=None):
        seen.extend(images)
        return real(backend, images, max_side, captions)

    monkeypatch.setattr(T, "spot_all", counted)
    cache = str(tmp_path / "cache")
    _run(demo, tmp_path / "a", cache)
    assert len(seen) == len(set(seen)) > 0                  # the first run computes each image
    n_first = len(seen)
    warm = _run(demo, tmp_path / "b", cache, **{"textspot.min_conf": 0.9})
    assert len(seen) == n_first                             # the rerun computes none
    cold = _run(demo, tmp_path / "c", None, **{"textspot.min_conf": 0.9, "run.image_cache": False})
    assert len(seen) == 2 * n_first
    assert warm.equals(cold)
    assert not (tmp_path / "c" / "_cache").exists()
    # a changed setting the spotted lines depend on is another namespace: computed again
    _run(demo, tmp_path / "d", cache, **{"textspot.max_side": 512})
    assert len(seen) == 3 * n_first
    # so is another version of the stage (its OCR code changed): computed again
    monkeypatch.setattr(TextSpotStage, "version", TextSpotStage.version + "-next")
    _run(demo, tmp_path / "e", cache, **{"textspot.max_side": 512})
    assert len(seen) == 4 * n_first
