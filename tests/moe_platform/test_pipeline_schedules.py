"""Pipeline parallelism's mechanics (parallel/pipeline.py) against one process: every schedule, at PP=2 and PP=4,
for an MoE model, a dense one, and one whose first stage holds no MoE layer, with DDP or FSDP2 and EP inside the
stages; three cases with multi-token prediction (the last stage's copy of the embedding under DDP and FSDP2, and
the V schedule's one shared embedding). Six AdamW steps of each case give the one-process run's losses (LM and
MTP), grad norms and tokens per expert (the MTP blocks' too).

Four gloo ranks start once for all cases (each start costs seconds on two cores); each case builds its own meshes.
The one-process reference runs here, in pytest's process: micro-batches of the same rows in the same order, each
loss (LM + aux) divided by their count, clipping at 1.0 and the aux-free bias update after every step. The trainer's
wiring of the same pieces (data, checkpoints, the NaN guard, liveness): test_pipeline.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from moe import Transformer
from moe.moe_layer import update_balancing_biases
from moe_platform.launch.compose import train_config
from moe_platform.testing import run_distributed

pytestmark = pytest.mark.slow
WORLD, STEPS, ROWS, MICRO, SEQ = 4, 6, 16, 2, 32  # ROWS per step in all, MICRO rows per micro-batch
ROUTING = ["model.moe.capacity_factor=1.0", "model.moe.min_capacity=1", "model.moe.router.bias_update_rate=0.001"]
# name: (model overrides, PP, EP, strategy, schedule, layout or None)
MTP = ["model.mtp.depth=2", "model.mtp.loss_weight=0.3"]
CASES = {
    "moe_tiny PP=2 DP=2 1f1b": (["model=moe_tiny", *ROUTING], 2, 1, "ddp", "1f1b", None),
    "moe_tiny PP=4 gpipe": (["model=moe_tiny", *ROUTING], 4, 1, "ddp", "gpipe", None),
    # the embedding's copy on rank 1 (stage 3 of 4) sharded like rank 0's, the two MTP modules' experts split by EP
    "moe_tiny MTP PP=2 EP=2 FSDP interleaved_1f1b": (
        ["model=moe_tiny", *ROUTING, *MTP], 2, 2, "fsdp", "interleaved_1f1b", None
    ),
    # rank 0 runs the first and the last stage: one embedding, read by both (a V schedule takes depth 1: config.py)
    "moe_tiny MTP PP=2 DP=2 dualpipev": (
        ["model=moe_tiny", *ROUTING, "model.mtp.depth=1"], 2, 1, "ddp", "dualpipev", None
    ),
    "dense_tiny PP=2 DP=2 zbv": (["model=dense_tiny"], 2, 1, "ddp", "zbv", None),
    # the first stage runs the dense layer 0 only: no aux loss, no routing counts, no hang; its MTP module (depth 1)
    # on the last stage with the embedding's copy
    "deepseek_v3_like_tiny MTP PP=2 EP=2 no MoE on stage 0": (
        ["model=deepseek_v3_like_tiny"], 2, 2, "ddp", "1f1b", [["embed", 0], [1, 2, "norm", "head"]]
    ),
}  # fmt: skip


def batches(vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (ROWS, SEQ + 1), generator=generator) for _ in range(STEPS)]


def config_of(case: str):
    overrides, pp, ep, strategy, schedule, layout = CASES[case]
    extra = [f"distributed.pipeline.layout={layout}".replace("'", "")] if layout else []
    return train_config([
        *overrides, f"distributed={strategy}", f"distributed.pipeline_parallel_size={pp}",
        f"distributed.expert_parallel_size={ep}", f"distributed.pipeline.schedule={schedule}",
        f"data.global_batch_size={ROWS}", f"trainer.micro_batch_size={MICRO}", f"data.seq_len={SEQ}", *extra,
    ])  # fmt: skip


def seeded_model(config) -> Transformer:
    torch.manual_seed(1234)
    return Transformer(config.model)


def tokens_per_expert(stats: dict) -> dict[int, list[int]]:
    return {layer: s.tokens_per_expert_before.tolist() for layer, s in sorted(stats.items())}


def one_process(case: str) -> list[tuple[float, float, float, dict]]:
    config = config_of(case)
    model = seeded_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = []
    for batch in batches(config.model.vocab_size):
        micro = batch.split(MICRO)
        losses, mtp_losses, counts = [], [], {}
        for rows in micro:
            out = model(rows[:, :-1], labels_BT=rows[:, 1:])  # labels: the MTP modules run, where the model has any
            lm = F.cross_entropy(out.logits.float().flatten(0, 1), rows[:, 1:].flatten())
            ((lm + out.aux_loss + out.mtp_loss) / len(micro)).backward()
            losses.append(float(lm.detach()))
            mtp_losses.append(float(out.mtp_loss.detach()))
            for layer, moe_out in enumerate(out.moe_outputs):  # the MTP modules' blocks follow the L layers
                if moe_out is not None:
                    counts[layer] = counts[layer] + moe_out.stats if layer in counts else moe_out.stats
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_balancing_biases(model)
        records.append((sum(losses) / len(losses), sum(mtp_losses) / len(micro), norm, tokens_per_expert(counts)))
    return records


def run_every_case_on_this_rank(rank: int, world_size: int) -> dict[str, list]:
    """Per case and step: (this rank's mean LM and MTP losses or None off the last stage, the grad norm, its layers'
    counts)."""
    import torch.distributed as dist

    from moe.stages import balanced_layout, parse_layout
    from moe_platform.parallel import fsdp, pipeline
    from moe_platform.train.pipeline_step import token_mean_loss

    results = {}
    for case, (_, pp, ep, strategy, schedule, layout_spec) in CASES.items():
        config = config_of(case)
        run = config.run_shape(world_size)
        if layout_spec is None:
            layout = balanced_layout(config.model, SEQ, pp, schedule, run.virtual_stages)
        else:
            layout = parse_layout(layout_spec, config.model.n_layers, pp, schedule)
        meshes = pipeline.build_meshes("cpu", pp, 1, ep)
        model = seeded_model(config)
        stage_ids = layout.stages_of_rank(meshes.pipeline_rank)
        pipeline.keep_stages(model, layout, stage_ids)
        pipeline.split_experts(model, meshes)
        stages = pipeline.stage_modules(model, layout, stage_ids)
        if strategy == "fsdp":
            pipeline.shard_stages(model, stages, meshes, fsdp.ShardingPolicy(True, False, False))
        D = meshes.dp_size
        m = ROWS // D // MICRO
        shape = pipeline.MicroBatchShape(MICRO, SEQ, config.model.d_model, config.model.vocab_size,
                                         torch.float32, torch.float32)  # fmt: skip
        schedule_ = pipeline.build_schedule(stages, stage_ids, layout, meshes, torch.device("cpu"), schedule, m,
                                            shape, token_mean_loss)  # fmt: skip
        shared = pipeline.share_embedding(model, layout, meshes)
        uncounted = shared.uncounted if shared is not None else frozenset()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        d = rank % D
        steps = []
        for batch in batches(config.model.vocab_size):
            rows = batch[d * ROWS // D : (d + 1) * ROWS // D]
            losses = []
            args = (rows[:, :-1],) if 0 in stage_ids else ()
            last = layout.num_stages - 1 in stage_ids
            labels = {"labels_BT": rows[:, 1:]} if config.model.mtp.depth else {}
            schedule_.step(*args, target=rows[:, 1:] if last else None, losses=losses if last else None,
                           return_outputs=False, **labels)  # fmt: skip
            if strategy == "fsdp":
                pipeline.sum_embedding_gradients(model, shared)
                norm = fsdp.clip_grad_norm(model, 1.0, uncounted)
            else:
                pipeline.sync_gradients(model, meshes)
                pipeline.sum_embedding_gradients(model, shared)
                norm = pipeline.clip_grad_norm(model, 1.0, meshes, uncounted)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update_balancing_biases(model, group=meshes.dp_group)
            counts, mtp_losses = {}, []
            for stage in stages:
                for record in stage.take_records():
                    if record.mtp_loss is not None:
                        mtp_losses.append(float(record.mtp_loss))
                    for layer, s in record.stats.items():
                        counts[layer] = counts[layer] + s if layer in counts else s
            for layer in counts:  # the stage's ranks route their own rows: the layer's count is their sum
                vector = counts[layer].to_vector()
                dist.all_reduce(vector, group=meshes.dp_group)
                counts[layer] = type(counts[layer]).from_vector(vector, counts[layer].tokens_per_expert_before.numel())
            mean = float(torch.stack(losses).detach().mean()) if losses else None
            mtp = sum(mtp_losses) / m if last else None
            steps.append((mean, mtp, norm, tokens_per_expert(counts)))
        results[case] = steps
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, list]]:
    return run_distributed(run_every_case_on_this_rank, WORLD, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_the_pipeline_trains_like_one_process(ranks, case: str) -> None:
    reference = one_process(case)
    mtp_depth = config_of(case).model.mtp.depth
    for step, (loss, mtp, norm, counts) in enumerate(reference):
        last_stage = [r[case][step] for r in ranks if r[case][step][0] is not None]
        assert last_stage, "some rank ran the last stage"
        assert sum(s[0] for s in last_stage) / len(last_stage) == pytest.approx(loss, rel=1e-5), (case, step)
        # L_MTP: the same on the last stage's ranks as in one process (0 = 0 without MTP)
        assert sum(s[1] for s in last_stage) / len(last_stage) == pytest.approx(mtp, rel=1e-5), (case, step)
        assert (mtp > 0) == (mtp_depth > 0)
        norms = {r[case][step][2] for r in ranks}
        assert max(norms) - min(norms) <= 1e-12 * max(norms), "every rank clips with one norm"
        assert norms.pop() == pytest.approx(norm, rel=1e-5), (case, step)
        merged = {}
        for r in ranks:
            merged.update(r[case][step][3])
        assert merged == counts, (case, step)  # each MoE layer reported by its stage, exactly, and no other
    assert all(math.isfinite(n) for _, _, n, _ in reference)
