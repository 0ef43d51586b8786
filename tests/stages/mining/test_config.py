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
    ({"hpm": {"pq_nbits": 0}}, r"hpm\.pq_nbits: must be in \[1, 16\]"),
    ({"hpm": {"widen": "some"}}, r"hpm\.widen: expected one of"),
    ({"hpm": {"noise_action": "delete"}}, r"hpm\.noise_action: expected one of"),
    ({"hpm": {"pair_probe": None}}, r"hpm\.pair_probe: expected int"),
    ({"hpm": {"pair_probe": 2.5}}, r"hpm\.pair_probe: expected int"),
    ({"hpm": {"pair_probe": -1}}, r"hpm\.pair_probe: must be >= 0"),
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
    """hpm.clusters / hpm.probe null: pass_io.AUTO (~256 rows per cluster, probe 60) in either
    precision; set, they win; exhaustive up to exact_max_n; one-space layouts only on a partial
    pass."""
    rows, probe = 256, 60
    from vlcurate.stages.mining.pass_io import pass_params
    cfg = C.load(None, {"hpm.precision": precision}).hpm
    p = pass_params(cfg, 1_000_000)
    assert (p.n_clusters, p.probe, p.space_probe) == (round(1e6 / rows), probe, 8)
    small = pass_params(cfg, 40_000)
    assert small.probe == small.n_clusters and small.space_probe == 0
    assert p.precision == precision
    told = pass_params(C.load(None, {"hpm.precision": precision, "hpm.clusters": 100,
                                     "hpm.probe": 7, "hpm.pair_probe": 0}).hpm, 1_000_000)
    assert (told.n_clusters, told.probe, told.space_probe) == (100, 7, 0)


def test_precision_auto_is_int8_where_the_hardware_has_int8_gemms():
    """hpm.precision auto (the default): int8 on a CPU whose flags list AVX512-VNNI or AMX
    (or where the fused VNNI screen runs), else fp32; explicit values stay."""
    from vlcurate.stages.mining import native
    from vlcurate.stages.mining.pass_io import pass_params, resolve_precision
    cfg = C.load(None, {}).hpm
    assert cfg.precision == "auto"
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        flags = []
    has = "avx512_vnni" in flags or "amx_int8" in flags or native.vnni()
    assert pass_params(cfg, 1_000_000, "cpu").precision == ("int8" if has else "fp32")
    for precision in ("fp32", "bf16", "int8"):
        assert resolve_precision(precision, "cpu") == precision


def test_noise_count_reaches_the_pass():
    """hpm.noise_count: exact (the default) completes the count of rows found short; probed
    decides on the probed clusters (test_noise.py shows what each flags)."""
    from vlcurate.stages.mining.pass_io import pass_params
    assert pass_params(C.load(None).hpm, 1_000_000, "cpu").exact_noise
    probed = C.load(None, {"hpm.noise_count": "probed"}).hpm
    assert not pass_params(probed, 1_000_000, "cpu").exact_noise
