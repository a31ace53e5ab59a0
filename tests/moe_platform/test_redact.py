"""No secret reaches the run dir: not config.yaml (run dir, checkpoints), not Hydra's .hydra/ record, not wandb's run
file, not a log line."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from moe_platform.config import load_run_config
from moe_platform.launch.compose import compose_train
from moe_platform.redact import REDACTED, is_secret_name, redact, redacted_yaml, secret_values
from moe_platform.testing import finished_wandb_files, moe_train


@pytest.mark.parametrize(
    "name",
    ["WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
     "token", "api_key", "data.hf.load_kwargs.token", "client_secret", "apikey"],
)  # fmt: skip
def test_credential_names_are_secret(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    ["eos_token", "pad_token", "num_tokens", "tokens_per_expert", "name_or_path", "TOKENIZERS_PARALLELISM",
     "keep_last", "monkey", "WANDB_MODE", "tokenizer"],
)  # fmt: skip
def test_ordinary_names_are_not(name):
    assert not is_secret_name(name)


def test_redact_replaces_secret_keys_known_values_and_override_values():
    secrets = {"envsecret-12345"}
    node = {
        "hf": {"load_kwargs": {"token": "short", "revision": "main"}},
        "use_stored_login": {"token": True},  # datasets' token=True: no secret, and its meaning must stay
        "note": "prefix envsecret-12345 suffix",
        "overrides": ["+data.hf.load_kwargs.token=short", "trainer.max_steps=3"],
        "override_dirname": "+x.api_key=abc,trainer.max_steps=3",
        "eos_token": "</s>",
    }
    assert redact(node, secrets) == {
        "hf": {"load_kwargs": {"token": REDACTED, "revision": "main"}},
        "use_stored_login": {"token": True},
        "note": f"prefix {REDACTED} suffix",
        "overrides": [f"+data.hf.load_kwargs.token={REDACTED}", "trainer.max_steps=3"],
        "override_dirname": f"+x.api_key={REDACTED},trainer.max_steps=3",
        "eos_token": "</s>",
    }
    assert secret_values({}, {"MY_FOO_KEY": "k" * 20, "PATH": "/bin"}) == {"k" * 20}


def test_resolved_config_hides_env_secrets_and_leaves_a_clean_config_unchanged(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_EnvSecretForInterpolation")
    clean = compose_train(["logging=all", "data=hf_hub"])
    with_env = compose_train(["data=hf_hub", "+data.hf.load_kwargs.token=${oc.env:HF_TOKEN}", "logging.wandb_group=x"])
    assert redacted_yaml(clean) == OmegaConf.to_yaml(clean, resolve=True)
    text = redacted_yaml(with_env)
    assert "hf_EnvSecretForInterpolation" not in text and f"token: {REDACTED}" in text


OVERRIDE_SECRET = "hf_FakeOverrideSecret0123456789"
ENV_SECRETS = {
    "WANDB_API_KEY": "wandbFakeApiKey0123456789abcdef",
    "HF_TOKEN": "hf_FakeEnvToken0123456789",
    "HUGGING_FACE_HUB_TOKEN": "hf_FakeHubToken0123456789",
    "MY_SERVICE_PASSWORD": "FakePassword0123456789",
}


def test_no_secret_reaches_the_run_dir_a_checkpoint_wandb_or_the_console(tmp_path: Path, monkeypatch) -> None:
    for name, value in ENV_SECRETS.items():
        monkeypatch.setenv(name, value)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"the quick brown fox {i} jumps. " * 3}) + "\n" for i in range(200)))
    run_dir = tmp_path / "run"
    result = moe_train(
        run_dir,
        "data=hf_local",
        f"data.hf.data_files=[{corpus}]",
        "data.synthetic.num_tokens=8388608",  # back to the default: FAST shrinks it, and hf_local must leave it be
        f"+data.hf.load_kwargs.token={OVERRIDE_SECRET}",  # datasets.load_dataset(token=...), as a user would pass it
        "logging=wandb",
        "trainer.max_steps=2",
        "trainer.save_final=true",
    )
    secrets = [OVERRIDE_SECRET, *ENV_SECRETS.values()]
    finished_wandb_files(run_dir, expected=1)  # wandb's service may still be writing the run file: grep it whole
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert {"config.yaml", "overrides.yaml", "hydra.yaml", "layout.json", "metrics.jsonl"} <= {f.name for f in files}
    assert any(f.suffix == ".wandb" for f in files)
    for path in files:
        data = path.read_bytes()
        leaked = [secret for secret in secrets if secret.encode() in data]
        assert not leaked, f"{path.relative_to(run_dir)} holds {leaked}"
    for stream in (result.stdout, result.stderr):
        assert not any(secret in stream for secret in secrets)
    # What was redacted stays readable: the key is there, and the saved config still loads as a run config.
    assert f"+data.hf.load_kwargs.token={REDACTED}" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    [checkpoint_config] = run_dir.glob("checkpoints/step_*/config.yaml")
    assert load_run_config(checkpoint_config).data.hf.load_kwargs == {"token": REDACTED}
