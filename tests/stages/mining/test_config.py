"""The hpm and positives config sections: defaults from the papers, errors that name the key."""
import pytest
from vlcurate.pipeline import config as C


def test_defaults_follow_the_papers():
    cfg = C.load()
    assert (cfg.hpm.tau_image, cfg.hpm.tau_text, cfg.hpm.dup_threshold) == (0.5, 0.5, 0.98)
    assert cfg.hpm.noise_action == "drop" and cfg.hpm.method == "auto"
    p = cfg.positives
    assert (p.p1, p.p1_text, p.p2, p.p3, p.recaptions) == (0.27, 0.24, 0.92, 0.99, 5)


@pytest.mark.parametrize("data,match", [
    ({"hpm": {"k": 0}}, r"hpm\.k: must be an int > 0"),
    ({"hpm": {"tau_image": 1.5}}, r"hpm\.tau_image: must be in \[0, 1\]"),
    ({"hpm": {"dup_threshold": -0.1}}, r"hpm\.dup_threshold: must be in \[0, 1\]"),
    ({"hpm": {"fast": {"pq_nbits": 0}}}, r"hpm\.fast\.pq_nbits: must be in \[1, 16\]"),
    ({"hpm": {"fast": {"widen": "some"}}}, r"hpm\.fast\.widen: expected one of"),
    ({"hpm": {"noise_action": "delete"}}, r"hpm\.noise_action: expected one of"),
    ({"hpm": {"engine": {"pair_probe": None}}}, r"hpm\.engine\.pair_probe: expected int"),
    ({"hpm": {"engine": {"pair_probe": 2.5}}}, r"hpm\.engine\.pair_probe: expected int"),
    ({"hpm": {"engine": {"pair_probe": -1}}}, r"hpm\.engine\.pair_probe: must be >= 0"),
    ({"positives": {"candidates": {"image": 2}}},
     r"positives\.candidates\.image: must be in \[-1, 1\]"),
    ({"positives": {"p2": 2}}, r"positives\.p2: must be in \[-1, 1\]"),
    ({"positives": {"max_positive": 3}}, r"did you mean 'max_positives'"),
])
def test_errors_name_the_key(data, match):
    with pytest.raises(C.ConfigError, match=match):
        C.from_dict(data)


def test_null_turns_duplicates_off():
    assert C.load(None, {"hpm.dup_threshold": None}).hpm.dup_threshold is None


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_the_pass_sizes_its_clusters_unless_told(precision):
    """hpm.engine.clusters / probe null: pass_io.AUTO (~256 rows per cluster, probe 60) in
    either precision; set, they win; exhaustive up to exact_max_n; one-space layouts only on a
    partial pass."""
    rows, probe = 256, 60
    from vlcurate.stages.mining.pass_io import pass_params
    cfg = C.load(None, {"hpm.engine.precision": precision})
    p = pass_params(cfg, 1_000_000)
    assert (p.n_clusters, p.probe, p.space_probe) == (round(1e6 / rows), probe, 8)
    small = pass_params(cfg, 40_000)
    assert small.probe == small.n_clusters and small.space_probe == 0
    assert p.precision == precision
    told = pass_params(C.load(None, {"hpm.engine": {"precision": precision, "clusters": 100,
                                                    "probe": 7, "pair_probe": 0}}), 1_000_000)
    assert (told.n_clusters, told.probe, told.space_probe) == (100, 7, 0)


def test_precision_auto_is_int8_where_the_hardware_has_int8_gemms():
    """hpm.engine.precision auto (the default): int8 on a CPU whose flags list AVX512-VNNI or AMX
    (or where the fused VNNI screen runs), else fp32; explicit values stay."""
    from vlcurate.stages.mining import native
    from vlcurate.stages.mining.pass_io import pass_params, resolve_precision
    cfg = C.load(None, {})
    assert cfg.hpm.engine.precision == "auto"
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        flags = []
    has = "avx512_vnni" in flags or "amx_int8" in flags or native.vnni()
    assert pass_params(cfg, 1_000_000, "cpu").precision == ("int8" if has else "fp32")
    for precision in ("fp32", "bf16", "int8"):
        assert resolve_precision(precision, "cpu") == precision


def test_noise_count_reaches_the_pass():
    """hpm.engine.noise_count: exact (the default) completes the count of rows found short; probed
    decides on the probed clusters (test_noise.py shows what each flags)."""
    from vlcurate.stages.mining.pass_io import pass_params
    assert pass_params(C.load(None), 1_000_000, "cpu").exact_noise
    probed = C.load(None, {"hpm.engine.noise_count": "probed"})
    assert not pass_params(probed, 1_000_000, "cpu").exact_noise


def test_floors_reach_the_pass_from_the_positives_section():
    """positives.candidates: the floors and the cap hpm's pass keeps candidate pairs by."""
    from vlcurate.stages.mining.pass_io import pass_params
    c = C.load(None, {"positives.candidates": {"image": 0.8, "text": 0.7, "cross": 0.2,
                                               "max_pairs": 9}})
    p = pass_params(c, 1_000_000, "cpu")
    assert (p.floor_i, p.floor_t, p.floor_x, p.max_pairs) == (0.8, 0.7, 0.2, 9)


MOVED = {"hpm.probe": "hpm.engine.probe", "hpm.chunk_rows": "hpm.engine.chunk_rows",
         "hpm.precision": "hpm.engine.precision", "hpm.clusters": "hpm.engine.clusters",
         "hpm.nlist": "hpm.fast.nlist", "hpm.k_prime": "hpm.fast.k_prime",
         "hpm.pair_image": "positives.candidates.image",
         "hpm.pair_cross": "positives.candidates.cross",
         "hpm.max_pairs": "positives.candidates.max_pairs"}


@pytest.mark.parametrize("old,new", MOVED.items())
def test_an_old_key_names_its_new_place(old, new):
    with pytest.raises(C.ConfigError, match=f"^{old}: moved to {new}$"):
        C.load(None, {old: 7})


def test_an_old_runs_snapshot_reads_its_moved_keys_at_their_new_place():
    """A run.json written before the keys moved still loads, with the values it ran with."""
    old = {"hpm": {"k": 3, "probe": 7, "chunk_rows": 99, "nlist": 4, "pair_image": 0.8,
                   "max_pairs": 12}, "positives": {"p2": 0.95}}
    assert C.from_snapshot({"hpm": {"chunk_rows": None}}).hpm.engine.chunk_rows == 32768
    c = C.from_snapshot(old)
    assert (c.hpm.k, c.hpm.engine.probe, c.hpm.engine.chunk_rows, c.hpm.fast.nlist) == \
        (3, 7, 99, 4)
    assert (c.positives.candidates.image, c.positives.candidates.max_pairs,
            c.positives.p2) == (0.8, 12, 0.95)
    assert c.positives.candidates.text == 0.9          # not in the snapshot: the default
