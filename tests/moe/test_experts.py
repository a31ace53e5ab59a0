"""GroupedExperts: the grouped_mm path equals the per-expert loop, forward and backward, on every slice layout.

Legend: A assignments, D model width, F expert hidden width, E (local) experts.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from moe.experts import GroupedExperts

D, FF, E = 16, 32, 4  # widths whose rows are 16-byte multiples in fp32 and bf16, so grouped_mm can run

requires_grouped_mm = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no F.grouped_mm")

# Slice lengths per expert: ordinary, idle experts (first, middle, last), everything on one expert, one row, A = 0,
# and random partitions with zeros forced in.
_gen = torch.Generator().manual_seed(1)
_RANDOM = [(torch.randint(0, 9, (E,), generator=_gen) * torch.randint(0, 2, (E,), generator=_gen)).tolist()]
_RANDOM += [torch.randint(0, 40, (E,), generator=_gen).tolist() for _ in range(2)]
SIZES = [[3, 5, 2, 6], [0, 4, 0, 3], [2, 0, 0, 0], [0, 0, 0, 7], [0, 13, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], *_RANDOM]
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def run(experts, x_AD, tokens_per_expert, use_grouped_mm, grad="random"):
    """Forward + backward on a fresh copy of x; returns y and the gradients of x and of every weight."""
    experts.use_grouped_mm = use_grouped_mm
    experts.zero_grad(set_to_none=True)
    x_AD = x_AD.detach().clone().requires_grad_(True)
    y_AD = experts(x_AD, tokens_per_expert)
    if grad == "sum":  # autograd hands y an expanded gradient: stride (0, 0)
        y_AD.float().sum().backward()
    elif grad == "transposed":  # column-major: row stride 1
        y_AD.backward(torch.randn(y_AD.shape[1], y_AD.shape[0], dtype=y_AD.dtype).t())
    else:
        y_AD.backward(torch.randn(y_AD.shape, dtype=y_AD.dtype, generator=torch.Generator().manual_seed(2)))
    return {"y": y_AD.detach(), "x.grad": x_AD.grad, **{f"{n}.grad": p.grad for n, p in experts.named_parameters()}}


def assert_paths_agree(grouped, loop, **tolerance):
    assert grouped.keys() == loop.keys()
    for name in grouped:
        assert grouped[name] is not None and loop[name] is not None, name
        torch.testing.assert_close(grouped[name], loop[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@requires_grouped_mm
@pytest.mark.parametrize("cpu_mm_slices", [True, False], ids=["mm_slices", "grouped_mm_kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("tokens_per_expert", SIZES, ids=str)
def test_grouped_mm_equals_the_loop_forward_and_backward(
    monkeypatch, cpu_mm_slices, dtype, activation, tokens_per_expert
):
    monkeypatch.setattr(GroupedExperts, "cpu_mm_slices", cpu_mm_slices)
    experts = GroupedExperts(D, FF, E, activation, init_std=0.3).to(dtype)
    x_AD = torch.randn(sum(tokens_per_expert), D, dtype=dtype)
    grouped = run(experts, x_AD, tokens_per_expert, use_grouped_mm=True)
    loop = run(experts, x_AD, tokens_per_expert, use_grouped_mm=False)
    assert grouped["y"].shape == (sum(tokens_per_expert), D) and grouped["y"].dtype == dtype
    assert_paths_agree(grouped, loop, **TOLERANCE[dtype])
    for e, count in enumerate(tokens_per_expert):
        if count == 0:  # an idle expert gets an exact zero gradient, not uninitialised memory
            assert grouped["w_up.grad"][e].abs().max() == 0 and grouped["w_down.grad"][e].abs().max() == 0


@requires_grouped_mm
@pytest.mark.parametrize("cpu_mm_slices", [True, False], ids=["mm_slices", "grouped_mm_kernel"])
@pytest.mark.parametrize("grad", ["sum", "transposed"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("tokens_per_expert", [[3, 0, 5, 2], [1, 0, 0, 0], [0, 0, 0, 0]], ids=str)
def test_grouped_mm_backward_takes_gradients_of_any_layout(
    monkeypatch, cpu_mm_slices, grad, activation, tokens_per_expert
):
    monkeypatch.setattr(GroupedExperts, "cpu_mm_slices", cpu_mm_slices)
    # grouped_mm's own backward raises on these ("Invalid strides/sizes" for stride 0, "strides should be multiple
    # of 16 bytes" for column-major); the callers' y.sum().backward() must just work.
    experts = GroupedExperts(D, FF, E, activation, init_std=0.3)
    x_AD = torch.randn(sum(tokens_per_expert), D)
    torch.manual_seed(3)
    grouped = run(experts, x_AD, tokens_per_expert, use_grouped_mm=True, grad=grad)
    torch.manual_seed(3)
    loop = run(experts, x_AD, tokens_per_expert, use_grouped_mm=False, grad=grad)
    assert_paths_agree(grouped, loop, **TOLERANCE[torch.float32])


@requires_grouped_mm
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_mm_follows_bf16_autocast_like_the_loop(activation):
    # grouped_mm is not on autocast's list, so the module casts by hand; both paths must run the matmuls in bf16.
    experts = GroupedExperts(D, FF, E, activation, init_std=0.3)
    x_AD = torch.randn(12, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grouped = run(experts, x_AD, [5, 0, 4, 3], use_grouped_mm=True)
        loop = run(experts, x_AD, [5, 0, 4, 3], use_grouped_mm=False)
    assert grouped["y"].dtype == loop["y"].dtype == torch.bfloat16
    assert grouped["w_up.grad"].dtype == grouped["x.grad"].dtype == torch.float32
    assert_paths_agree(grouped, loop, **TOLERANCE[torch.bfloat16])


@requires_grouped_mm
@pytest.mark.parametrize(
    "d_model, d_ff, dtype, expect_grouped",
    [
        (D, FF, torch.float32, True),
        (D, FF, torch.bfloat16, True),
        (D, FF, torch.float64, False),  # grouped_mm has no fp64 kernel (the gradcheck and parity tests use fp64)
        (4, 6, torch.float32, False),  # F·4 bytes = 24: rows not 16-byte strided
        (12, 16, torch.bfloat16, False),  # D·2 bytes = 24
    ],
)
def test_auto_uses_grouped_mm_exactly_where_it_can_run(monkeypatch, d_model, d_ff, dtype, expect_grouped):
    calls = []  # one per grouped projection: cpu_mm_slices=False runs torch's grouped_mm kernel here too
    monkeypatch.setattr(GroupedExperts, "cpu_mm_slices", False)
    real_grouped_mm = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **kw: calls.append(1) or real_grouped_mm(*a, **kw))
    experts = GroupedExperts(d_model, d_ff, 3, "swiglu").to(dtype)
    experts(torch.randn(5, d_model, dtype=dtype), [2, 0, 3]).sum().backward()
    assert (len(calls) > 0) == expect_grouped
    calls.clear()
    experts.use_grouped_mm = False
    experts(torch.randn(5, d_model, dtype=dtype), [2, 0, 3])
    assert calls == []
    experts.use_grouped_mm = True
    if expect_grouped:
        experts(torch.randn(5, d_model, dtype=dtype), [2, 0, 3])
        assert len(calls) == 3
    else:
        with pytest.raises(ValueError, match="use_grouped_mm=None"):
            experts(torch.randn(5, d_model, dtype=dtype), [2, 0, 3])


@requires_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_traces_under_torch_compile_and_on_meta_tensors(dtype):
    # grouped_mm's meta kernel (what compile and meta tensors run) takes only bf16: fp32 must trace the loop.
    experts = GroupedExperts(D, FF, E, "swiglu", init_std=0.3).to(dtype)
    x_AD = torch.randn(10, D, dtype=dtype)
    expected = run(experts, x_AD, [3, 0, 5, 2], use_grouped_mm=None)
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    experts.zero_grad(set_to_none=True)
    x_compiled = x_AD.clone().requires_grad_(True)
    y_compiled = compiled(x_compiled, [3, 0, 5, 2])
    y_compiled.backward(torch.randn(y_compiled.shape, dtype=dtype, generator=torch.Generator().manual_seed(2)))
    torch.testing.assert_close(y_compiled.detach(), expected["y"], **TOLERANCE[dtype])
    torch.testing.assert_close(experts.w_down.grad, expected["w_down.grad"], **TOLERANCE[dtype])
    torch.testing.assert_close(x_compiled.grad, expected["x.grad"], **TOLERANCE[dtype])
    meta = GroupedExperts(D, FF, E, "swiglu").to(dtype=dtype, device="meta")
    assert meta(torch.empty(10, D, dtype=dtype, device="meta"), [3, 0, 5, 2]).shape == (10, D)


@requires_grouped_mm
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("tokens_per_expert", [[3, 0, 5, 2], [0, 0, 0, 0]], ids=str)
def test_flop_counter_counts_grouped_mm_like_the_loops_matmuls(activation, tokens_per_expert):
    # The FLOP ledger is checked against FlopCounterMode, which must not see the grouped path as free.
    experts = GroupedExperts(D, FF, E, activation)
    flops = {}
    for use_grouped_mm in (True, False):
        experts.use_grouped_mm = use_grouped_mm
        x_AD = torch.randn(sum(tokens_per_expert), D, requires_grad=True)
        with FlopCounterMode(display=False) as forward:
            y_AD = experts(x_AD, tokens_per_expert)
        with FlopCounterMode(display=False) as backward:
            y_AD.sum().backward()
        flops[use_grouped_mm] = forward.get_total_flops(), backward.get_total_flops()
    forward_flops = (3 if activation == "swiglu" else 2) * 2 * sum(tokens_per_expert) * D * FF
    assert flops[True] == flops[False] == (forward_flops, 2 * forward_flops)  # backward: grad x and grad w


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("tokens_per_expert", [[2, 3], [2, 3, 0, 0, 0], [2, 2, 0]], ids=str)
def test_tokens_per_expert_must_cover_x_with_one_count_per_local_expert(use_grouped_mm, tokens_per_expert):
    if use_grouped_mm and not hasattr(F, "grouped_mm"):
        pytest.skip("this torch has no F.grouped_mm")
    experts = GroupedExperts(D, FF, 3, "gelu", use_grouped_mm=use_grouped_mm)
    with pytest.raises(ValueError, match="one count per local expert \\(3\\) summing to x_AD's 5 rows"):
        experts(torch.randn(5, D), tokens_per_expert)


def test_the_loop_keeps_an_empty_batch_in_the_graph():
    experts = GroupedExperts(4, 6, 3, "swiglu", use_grouped_mm=False)
    x_AD = torch.randn(0, 4, requires_grad=True)
    y_AD = experts(x_AD, [0, 0, 0])
    assert y_AD.shape == (0, 4)
    y_AD.sum().backward()
    assert x_AD.grad.shape == (0, 4) and experts.w_down.grad.abs().max() == 0
