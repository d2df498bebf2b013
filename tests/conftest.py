"""Shared fixtures: a tiny model built once per session, the shared data folder."""

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_corpus(0, 500), hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from posttrain.models.load import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))
