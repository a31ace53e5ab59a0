"""bench/mla_decode.py runs in its quick mode: both decode paths agree and the latent cache is the seed's size."""


def test_quick_run_decodes_both_ways_alike_and_sizes_the_latent_cache(load_bench) -> None:
    bench = load_bench("mla_decode")
    result = bench.main(["--quick"])
    assert result["max_diff"] < 1e-4
    # quick shape: B=2, L=2, S=56, d_c=32, d_r=8, fp32; H=4 heads of n + r + v = 40
    assert result["latent_bytes"] == 2 * 2 * 56 * (32 + 8) * 4
    assert result["mha_bytes"] == 2 * 2 * 56 * 4 * 40 * 4
