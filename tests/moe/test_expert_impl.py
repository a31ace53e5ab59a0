"""moe.experts_impl through the whole MoELayer: grouped_mm and the per-expert loop compute the same layer, and the
layer's forward reads to the host exactly once (the experts' split sizes).

Legend: B batch, T positions, D model width, F expert hidden width, E experts, K experts per token.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from moe.errors import ModelConfigError
from moe.moe_config import MoEConfig, RouterConfig
from moe.moe_layer import MoELayer

B, T, D, FF, E, K = 2, 24, 16, 32, 4, 2  # widths whose rows are 16-byte multiples in fp32 and bf16
IDLE = 3  # the expert that the router is built never to choose

requires_grouped_mm = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no F.grouped_mm")


def make_layer(impl, activation, capacity_factor, dtype, **overrides):
    config = MoEConfig(
        num_experts=E, top_k=K, expert_d_ff=FF, capacity_factor=capacity_factor, experts_impl=impl, **overrides
    )
    torch.manual_seed(0)
    layer = MoELayer(D, config, activation, init_std=0.3).train()
    with torch.no_grad():  # inputs lean along u; expert IDLE's router row points against u, so it never wins
        layer.router.weight[IDLE] = -10.0 * unit_direction()
    return layer.to(dtype)


def unit_direction():
    return torch.ones(D) / D**0.5


def make_input(dtype):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(B, T, D, generator=gen) + 3.0 * unit_direction()).to(dtype)


def forward_backward(layer, x_BTD):
    """Output, both losses and every parameter gradient of one training step of `layer`."""
    layer.zero_grad(set_to_none=True)
    out = layer(x_BTD)
    grad_BTD = torch.randn(out.output.shape, generator=torch.Generator().manual_seed(2)).to(out.output.dtype)
    torch.autograd.backward([out.output, out.aux_loss + out.z_loss], [grad_BTD, torch.ones_like(out.aux_loss)])
    results = {"output": out.output.detach(), "aux_loss": out.aux_loss.detach(), "z_loss": out.z_loss.detach()}
    results["tokens_per_expert_after"] = out.stats.tokens_per_expert_after
    return results | {f"{name}.grad": p.grad for name, p in layer.named_parameters()}


@requires_grouped_mm
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 0.9], ids=["dropless", "cf0.9"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_grouped_mm_layer_equals_loop_layer(dtype, capacity_factor, activation):
    x_BTD = make_input(dtype)
    grouped = forward_backward(make_layer("grouped_mm", activation, capacity_factor, dtype), x_BTD)
    loop = forward_backward(make_layer("loop", activation, capacity_factor, dtype), x_BTD)
    counts_E = grouped["tokens_per_expert_after"]
    assert counts_E[IDLE] == 0 and (counts_E > 0).sum() == E - 1  # one idle expert, the others all busy
    if capacity_factor is not None:  # the capacity really drops assignments
        assert counts_E.sum() < B * T * K
    assert grouped.keys() == loop.keys()
    for name in grouped:
        assert grouped[name] is not None, name
        # On CPU both paths run the same matmul per expert slice, so they agree to the bit, in bf16 too.
        torch.testing.assert_close(grouped[name], loop[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    for name in ("experts.w_up.grad", "experts.w_down.grad"):
        assert grouped[name][IDLE].abs().max() == 0  # an exact zero, not uninitialised memory


def test_experts_impl_is_validated_and_reaches_the_experts():
    with pytest.raises(ModelConfigError, match="experts_impl='fast'"):
        MoEConfig(num_experts=E, top_k=K, expert_d_ff=FF, experts_impl="fast")
    for impl, flag in (("auto", None), ("grouped_mm", True), ("loop", False)):
        layer = MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_d_ff=FF, experts_impl=impl), "gelu")
        assert layer.experts.use_grouped_mm is flag


@requires_grouped_mm
def test_grouped_mm_where_it_cannot_run_fails_with_one_sentence():
    layer = make_layer("grouped_mm", "gelu", None, torch.float64)  # grouped_mm has no float64 kernel
    with pytest.raises(ValueError, match="experts_impl='auto'"):
        layer(make_input(torch.float64))


# Tensor methods and torch functions that read device data to the host (on CUDA: a sync that stalls the launch
# queue), including those whose output shape depends on the data and bincount, which reads max(ids) first.
_HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"}
_HOST_READS |= {"masked_select", "unique", "unique_consecutive", "bincount", "histc"}


class HostReads(TorchFunctionMode):
    """Records every call that reads device data to the host, by name."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _HOST_READS:
            self.calls.append(name)
        elif name == "repeat_interleave" and not isinstance(kwargs.get("repeats", args[1:2] or [0])[0], int):
            if "output_size" not in kwargs:  # tensor repeats: the output length is read from the device
                self.calls.append(name)
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args[1]):
            self.calls.append(f"{name}[bool mask]")
        return func(*args, **kwargs)


def _has_bool_index(index) -> bool:
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "cf1.0"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"aux_loss_scope": "sequence"}, {"router": RouterConfig(bias_update_rate=1e-3)}, {"drop_policy": "probs"}],
    ids=["default", "sequence_loss", "bias_balancing", "probs_policy"],
)
@pytest.mark.parametrize("impl", ["auto", "loop"])
def test_forward_reads_to_the_host_exactly_once(capacity_factor, overrides, impl):
    layer = make_layer(impl, "swiglu", capacity_factor, torch.float32, **overrides)
    x_BTD = make_input(torch.float32)
    with HostReads() as reads:
        out = layer(x_BTD)
    assert reads.calls == ["tolist"], reads.calls  # dispatch's split sizes, and nothing else
    assert out.stats.tokens_per_expert_after.sum() > 0


def test_the_host_read_detector_sees_what_it_must():
    x = torch.tensor([2, 0, 1])
    with HostReads() as reads:
        bool(x[0]), int(x[1]), x[x > 0], torch.bincount(x), x.nonzero(), x.repeat_interleave(x)
    assert reads.calls == ["__bool__", "__int__", "__getitem__[bool mask]", "bincount", "nonzero", "repeat_interleave"]
