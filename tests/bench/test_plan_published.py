"""bench/plan_published.py: the published figures it compares against are the ones its docstring derives, and the
rank it reports for a published layout is the planner's own place of the first plan with that PP × EP."""

import pytest


def test_deepseek_v3s_gpu_hours_are_tokens_per_second_a_gpu(load_bench) -> None:
    bench = load_bench("plan_published")
    deepseek = [run for run in bench.RUNS if run.name.startswith("DeepSeek-V3")]
    for run in deepseek:  # 180 K H800 GPU-hours per 1e12 tokens
        assert run.tokens_per_s_per_gpu * 180e3 * 3600 == pytest.approx(1e12)
        assert (run.nodes * run.gpus_per_node, run.pipeline, run.expert) == (2048, 16, 64)


def test_the_reported_rank_is_the_first_fitting_plan_with_the_published_layout(load_bench) -> None:
    from moe_platform.launch.compose import train_config
    from moe_platform.plan.hardware import cluster_of
    from moe_platform.plan.layouts import plan_layouts

    bench = load_bench("plan_published")
    run = next(run for run in bench.RUNS if "GBS 512" in run.name)
    row = bench.evaluate(run, [])
    planning = plan_layouts(train_config(list(run.overrides)), cluster_of(run.nodes, run.gpus_per_node, run.gpu))
    shapes = [(p.layout.pipeline_parallel_size, p.layout.expert_parallel_size) for p in planning.fitting]
    assert row.rank == shapes.index((run.pipeline, run.expert)) + 1
    plan = planning.fitting[row.rank - 1]
    assert row.predicted_tokens == pytest.approx(plan.time.tokens_per_s / 64)
    # TFLOP/s a GPU and tokens/s a GPU are one figure in two units, through the platform's FLOPs per token.
    assert row.predicted_tflops * 1e12 / row.predicted_tokens == pytest.approx(plan.time.model_flops_per_token)
    assert row.published_tokens == pytest.approx(468e12 / plan.time.model_flops_per_token)
