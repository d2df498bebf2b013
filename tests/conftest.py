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


@pytest.fixture(scope="session")
def small_task(tmp_path_factory):
    """One-digit addition, 8 demonstrations per problem of which 70% drop the carry, and a short SFT on it
    (about 25 s): greedy decoding then answers only the carry-free problems right, and RL has a choice to make."""
    from posttrain.data.synthetic import tokenizer_corpus, write_task
    from posttrain.models.tiny import build_tiny_model
    from posttrain.trainer.sft import SFTArgs, run_sft

    out = tmp_path_factory.mktemp("small_task")
    files = write_task(out / "data", seed=0, operands=range(0, 10), held_out=0, dev=10, copies=8)
    base = build_tiny_model(out / "init", tokenizer_corpus(0, 500), seed=0)
    run_sft(SFTArgs(model_path=str(base), train_files=[str(files["sft_train"])], output_dir=str(out / "sft"),
                    epochs=15, lr=2e-3, batch_size=32, max_length=64, eval_every=1000, seed=0, quiet=True))
    return out, files
