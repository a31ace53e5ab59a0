"""Activation checkpointing: keep a sub-layer's input, recompute its activations during backward.

Modes (`Transformer.set_activation_checkpointing`):
  * "none": autograd keeps every activation a block's backward needs.
  * "moe":  each MoE layer (its norm, router, dispatch, experts, combine) keeps only its input x_BTD and runs again
    in backward: the activations that grow with K·N·F (the gathered rows, the expert hidden [A, F]) are not kept.
  * "full": each transformer block keeps only its input and runs again in backward (attention and FFN alike).

Recomputation goes through `torch.utils.checkpoint` (non-reentrant), which restores the RNG state, so dropout and
router jitter draw the same numbers twice and gradients equal the unrecomputed ones. What the forward does besides
computing (the router's count of assignments for bias balancing) must happen once per forward: code with such a
side effect asks `is_recomputing()` and skips it during the second run.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "moe", "full")

_state = threading.local()  # the backward pass recomputes on the thread that runs it


def is_recomputing() -> bool:
    """True while a checkpointed sub-layer runs again during backward."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), _recomputing()


def recompute_in_backward(function: Callable[..., Any], *args: Any) -> Any:
    """function(*args), keeping only `args` for backward and running `function` again there.

    Inside torch.compile the checkpoint is traced into the compiled graph, whose backward recomputes the tensors
    the gradients need and none of the Python side effects, so `is_recomputing` has nothing to guard there; and
    Dynamo refuses a `context_fn` (measured, torch 2.13: a block compiled without a graph break failed)."""
    if torch.compiler.is_compiling():
        return checkpoint(function, *args, use_reentrant=False)
    return checkpoint(function, *args, use_reentrant=False, context_fn=_contexts)
