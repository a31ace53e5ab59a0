"""A training run on a weighted mixture (data=mixture): it logs each source's tokens and share per window beside its
weight and each source's eval loss, moe-report draws them, a stop and resume trains bit for bit as the
uninterrupted run, and a changed mixture is refused in one sentence with the run left as it was. (The blend, its
world-size independence and its resume at another world size: tests/data_pipeline/test_mixture.py.)"""

from pathlib import Path

import pytest

from data_pipeline.mixture import deviation_bound
from moe_platform.monitor.report import build_figures, read_records
from moe_platform.testing import EXACT, Job, assert_resumes_exactly, read_metrics

pytestmark = pytest.mark.slow

SOURCES = "[{name: web, weight: 0.6, synthetic: {num_tokens: 65536, seed: 1}}, " \
          "{name: code, weight: 0.4, synthetic: {num_tokens: 65536, seed: 2}}]"  # fmt: skip
# FAST sets data.synthetic.num_tokens, which a mixture refuses (each source has its own): put back at its default
MIXTURE = (
    "data=mixture",
    "data.synthetic.num_tokens=8388608",
    f"data.mixture={SOURCES}",
    "trainer.eval_every=3",
    "data.val.fraction=0.05",
)
BATCH = 8  # FAST's data.global_batch_size: one window per log (log_every=1) holds 8 samples


def test_a_mixture_logs_each_source_resumes_bit_for_bit_and_refuses_a_changed_mix(tmp_path: Path) -> None:
    reference = tmp_path / "uninterrupted"
    Job(*MIXTURE, "trainer.save_final=true").run(reference)
    train, evals = read_metrics(reference)
    bound = 2 * deviation_bound(2) / BATCH  # a window's share: the difference of two prefixes, each within the bound
    for record in train.values():
        for name, weight in (("web", 0.6), ("code", 0.4)):
            assert record[f"data/weight/{name}"] == pytest.approx(weight)
            assert abs(record[f"data/share/{name}"] - weight) <= bound + 1e-9
        assert record["data/tokens/web"] + record["data/tokens/code"] == BATCH * 32  # FAST's data.seq_len
        assert 0 <= record["data_wait_frac"] < 1  # the loop's wait for batches over its training time
    for record in evals.values():
        expected = 0.6 * record["eval/loss/web"] + 0.4 * record["eval/loss/code"]
        assert record["eval/loss"] == pytest.approx(expected, rel=1e-12), "eval/loss: the mean at the weights"
    mix = build_figures(read_records(reference / "metrics.jsonl"), None, None)["fig-data-mix"]
    assert {trace.name for trace in mix.data} == {"web", "code"} and len(mix.data) == 6  # share, weight, eval

    run_dir = tmp_path / "stopped"
    Job(*MIXTURE, stop_at=3).run(run_dir)
    metrics = (run_dir / "metrics.jsonl").read_text()
    changed = SOURCES.replace("0.6", "0.7").replace("0.4", "0.3")
    refused = Job(*MIXTURE, f"data.mixture={changed}").run(run_dir, "resume=auto", check=False)
    assert refused.returncode != 0 and "weight of 'web' 0.6 -> 0.7" in refused.stderr, refused.stderr[-2000:]
    assert "data.allow_changed_mixture=true" in refused.stderr
    assert (run_dir / "metrics.jsonl").read_text() == metrics, "the refused start left the run as it was"
    resumed = Job(*MIXTURE, "trainer.save_final=true")
    match = {"loss": EXACT, "grad_norm": EXACT, "data/tokens/web": EXACT, "data/share/code": EXACT}
    assert assert_resumes_exactly(run_dir, reference, resumed, match=match, weights=True) == [3]
