"""RoPE (seed 000): the rotated q·k score depends only on the position difference."""

import torch

from moe.rope import apply_rope, rope_tables

TOL = dict(atol=1e-10, rtol=1e-10)


def rotated(x_d: torch.Tensor, position: int, theta: float = 10000.0) -> torch.Tensor:
    cos, sin = rope_tables(torch.tensor([position]), x_d.numel(), theta, torch.float64)
    return apply_rope(x_d.view(1, 1, 1, -1), cos, sin).flatten()


def test_same_position_score_equals_unrotated_score() -> None:
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    for m in (0, 1, 7, 250):
        torch.testing.assert_close(rotated(q, m) @ rotated(k, m), q @ k, **TOL)


def test_shifting_both_positions_keeps_the_score() -> None:
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    for m, n in ((2, 7), (0, 0), (9, 3)):
        base = rotated(q, m) @ rotated(k, n)
        for shift in (1, 11, 100):
            torch.testing.assert_close(rotated(q, m + shift) @ rotated(k, n + shift), base, **TOL)
        # …and equals the score of the unrotated query with a key rotated by the difference alone.
        torch.testing.assert_close(base, q @ rotated(k, n - m) if n >= m else rotated(q, m - n) @ k, **TOL)


def test_different_offsets_give_different_scores() -> None:
    """The relative position is really encoded: distance 1 and distance 5 score differently."""
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    assert not torch.allclose(rotated(q, 3) @ rotated(k, 4), rotated(q, 3) @ rotated(k, 8))


def test_rotation_preserves_norm_and_leaves_position_zero_alone() -> None:
    x = torch.randn(8, dtype=torch.float64)
    torch.testing.assert_close(rotated(x, 0), x, **TOL)
    torch.testing.assert_close(rotated(x, 123).norm(), x.norm(), **TOL)


def test_two_dimensional_seed_example() -> None:
    """Seed 000's script: q=(1,2), k=(3,-1), ω=0.17, m=2, n=7; one pair with θ chosen so ω_0 = 1 → scale angles."""
    q, k = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0, -1.0], dtype=torch.float64)

    # With head_dim 2 the only frequency is θ^0 = 1, so position p rotates by p radians; use positions as angles
    # by comparing against an explicit rotation matrix.
    def matrix(angle: float) -> torch.Tensor:
        c, s = torch.cos(torch.tensor(angle, dtype=torch.float64)), torch.sin(torch.tensor(angle, dtype=torch.float64))
        return torch.stack([torch.stack([c, -s]), torch.stack([s, c])])

    for position in (0, 2, 7):
        torch.testing.assert_close(rotated(q, position), matrix(float(position)) @ q, **TOL)
    observed = rotated(q, 2) @ rotated(k, 7)
    torch.testing.assert_close(observed, q @ (matrix(5.0) @ k), **TOL)
