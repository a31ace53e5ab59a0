"""Config dataclasses: plain types a Hydra ConfigStore can hold, and validation that names the fix."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError

from data_pipeline import DataConfig, HFSourceConfig, SyntheticConfig, TokenizedConfig, TokenizerConfig, ValConfig


def test_data_config_round_trips_through_omegaconf():
    config = DataConfig(
        source="hf",
        hf=HFSourceConfig(path="json", data_files=["a.jsonl"], load_kwargs={"field": "rows"}),
        tokenizer=TokenizerConfig(name_or_path="tok.json", eos_token="<eos>"),
        val=ValConfig(split="validation", data_files=["v.jsonl"]),
    )
    structured = OmegaConf.structured(config)
    structured.seq_len = 512  # typed fields accept overrides...
    with pytest.raises(ConfigAttributeError):
        structured.unknown_key = 1  # ...and reject unknown keys
    back = OmegaConf.to_object(structured)
    assert isinstance(back, DataConfig) and isinstance(back.hf, HFSourceConfig)
    assert back.seq_len == 512 and back.hf.data_files == ["a.jsonl"] and back.val.split == "validation"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"source": "web"}, "data.source='web' must be one of"),
        ({"hf": HFSourceConfig(path="json")}, "data.hf is set but data.source='synthetic'"),
        ({"tokenizer": TokenizerConfig(name_or_path="gpt2")}, "data.tokenizer is unused"),
        ({"source": "hf"}, "data.hf.path is empty"),
        (
            {"source": "hf", "hf": HFSourceConfig(path="x"), "synthetic": SyntheticConfig(seed=1)},
            "data.synthetic is set",
        ),
        ({"val": ValConfig(split="validation")}, "data.val.split needs data.source=hf"),
        (
            {"source": "hf", "hf": HFSourceConfig(path="json", data_files=["a"]), "val": ValConfig(split="validation")},
            "needs data.val.data_files",
        ),
        ({"source": "tokenized"}, "data.tokenized.path is empty"),
        ({"tokenized": TokenizedConfig(path="shards")}, "data.tokenized is set but data.source='synthetic'"),
        (
            {"source": "tokenized", "tokenized": TokenizedConfig(path="shards"), "val": ValConfig(split="validation")},
            "data.val.split needs data.source=hf; the tokenized source holds out data.val.fraction",
        ),
        ({"seq_len": 0}, "data.seq_len=0"),
    ],
)
def test_data_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DataConfig(**kwargs)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: SyntheticConfig(branching=65), "synthetic.branching=65"),
        (lambda: SyntheticConfig(mean_doc_len=0.5), "synthetic.mean_doc_len"),
        (lambda: HFSourceConfig(streaming=True, num_proc=2), "hf.num_proc is unused"),
        (lambda: HFSourceConfig(shuffle_buffer=5), "hf.shuffle_buffer only applies"),
        (lambda: HFSourceConfig(streaming=True, shuffle_buffer=-1), "hf.shuffle_buffer=-1 must be >= 0"),
        (lambda: HFSourceConfig(text_field=""), "hf.text_field must name"),
        (lambda: ValConfig(split="validation", fraction=0.2), "val.fraction is unused"),
        (lambda: ValConfig(fraction=1.0), r"val.fraction=1.0 must be in \[0, 1\)"),
        (lambda: TokenizerConfig(eos_token="</s>"), "only apply to a Hugging Face tokenizer"),
    ],
)
def test_component_config_errors_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()
