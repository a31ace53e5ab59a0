"""KV cache (seed 001 §1.5): the cache stores only H_kv heads, overflow is a clear error, and generate() uses it.
Step-by-step decoding from the cache equals the full-prefix forward for every attention variant in
test_attention_variants.py."""

import pytest
import torch

from moe import ModelConfig, Transformer, kv_cache_bytes

TOL = dict(atol=1e-10, rtol=1e-8)


def tiny_model(**overrides) -> Transformer:
    fields = dict(vocab_size=40, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40, max_seq_len=48)
    fields.update(overrides)
    return Transformer(ModelConfig(**fields)).double().eval()


# Chunked cached decode equals the full forward for every attention and position variant:
# tests/moe/test_attention_variants.py.


def test_cache_holds_only_kv_heads_and_matches_the_ledger() -> None:
    model = tiny_model(n_heads=8, n_kv_heads=2, d_model=64)
    cache = model.new_kv_cache(batch_size=3, max_len=20)
    assert cache.k_LBKSd.shape == (3, 3, 2, 20, 8)
    assert cache.num_bytes == kv_cache_bytes(model.config, batch_size=3, seq_len=20, bytes_per_element=8)


def test_cache_overflow_is_a_clear_error() -> None:
    model = tiny_model()
    cache = model.new_kv_cache(batch_size=1, max_len=4)
    model(torch.randint(0, 40, (1, 3)), kv_cache=cache)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        model(torch.randint(0, 40, (1, 2)), kv_cache=cache)


def test_sequence_longer_than_max_seq_len_is_a_clear_error() -> None:
    model = tiny_model(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.randint(0, 40, (1, 9)))


def test_greedy_generate_equals_recomputing_the_full_forward() -> None:
    model = tiny_model()
    prompt = torch.randint(0, 40, (2, 5))
    generated = model.generate(prompt, max_new_tokens=8, temperature=0)
    assert generated.shape == (2, 13)
    assert torch.equal(generated[:, :5], prompt)
    tokens = prompt
    for _ in range(8):
        next_token = model(tokens).logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, next_token], dim=1)
    assert torch.equal(generated, tokens)


def test_top_k_one_sampling_is_greedy_and_sampling_is_reproducible() -> None:
    model = tiny_model()
    prompt = torch.randint(0, 40, (1, 4))
    greedy = model.generate(prompt, max_new_tokens=6, temperature=0)
    top1 = model.generate(prompt, max_new_tokens=6, temperature=1.3, top_k=1)
    assert torch.equal(greedy, top1)
    sample_a = model.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    sample_b = model.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(sample_a, sample_b)


def test_top_k_sampling_only_draws_from_the_top_k() -> None:
    model = tiny_model()
    prompt = torch.randint(0, 40, (64, 3))
    allowed = model(prompt).logits[:, -1].topk(3, dim=-1).indices
    drawn = model.generate(prompt, 1, temperature=5.0, top_k=3, generator=torch.Generator().manual_seed(0))[:, -1]
    assert (allowed == drawn[:, None]).any(dim=-1).all()


def expected_with_eos(reference_BT: torch.Tensor, prompt_len: int, eos: int) -> torch.Tensor:
    """What generate(eos_id=eos) must return, derived from the greedy run without EOS: each row keeps its tokens up
    to its first EOS and EOS after it; the output ends at the step where the last row emitted its EOS."""
    new_BS = reference_BT[:, prompt_len:].clone()
    is_eos_BS = new_BS == eos
    finished_BS = is_eos_BS.cumsum(dim=1) > 0
    new_BS[finished_BS] = eos
    if bool(finished_BS[:, -1].all()):
        last_needed = int(is_eos_BS.float().argmax(dim=1).max())  # the step at which the last row finished
        new_BS = new_BS[:, : last_needed + 1]
    return torch.cat([reference_BT[:, :prompt_len], new_BS], dim=1)


def test_every_row_stops_at_its_own_eos_and_generation_ends_when_all_have() -> None:
    """Rows decode independently (a dense model, no padding), so the greedy run without EOS predicts the run with
    any EOS token exactly; every token that occurs in that run is tried as EOS, and every row is checked."""
    model = tiny_model()
    prompt_len, max_new = 4, 12
    prompt = torch.randint(0, 40, (4, prompt_len))
    reference = model.generate(prompt, max_new, temperature=0)
    candidates = sorted(set(reference[:, prompt_len:].flatten().tolist()))
    stopped_early = some_row_never_stopped = 0
    for eos in candidates:
        out = model.generate(prompt, max_new, temperature=0, eos_id=eos)
        expected = expected_with_eos(reference, prompt_len, eos)
        assert torch.equal(out, expected), f"eos={eos}"
        stopped_early += out.shape[1] < prompt_len + max_new
        some_row_never_stopped += bool((out[:, prompt_len:] != eos).all(dim=1).any())
    # Both regimes occurred, so both were checked: every row finished early, and a row that never met its EOS.
    assert stopped_early > 0 and some_row_never_stopped > 0, (stopped_early, some_row_never_stopped)


def test_generate_rejects_running_past_max_seq_len() -> None:
    model = tiny_model(max_seq_len=10)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(torch.randint(0, 40, (1, 6)), max_new_tokens=5)
