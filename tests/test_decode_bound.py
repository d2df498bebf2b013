"""benchmarks/decode_bound.py's byte count, against published sizes and a built model (its timing runs on a GPU:
tools/gpu_check.sh)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from decode_bound import SHAPES, parameter_count, step_bytes  # noqa: E402


def test_parameter_counts_are_the_published_qwen2_5_sizes():
    """Qwen2.5-0.5B has 494,032,768 parameters and Qwen2.5-1.5B 1,543,714,304 (their checkpoints, tied
    embeddings)."""
    assert parameter_count(SHAPES["L"]) == 494_032_768
    assert parameter_count(SHAPES["1.5B"]) == 1_543_714_304


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_is_a_built_models(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=300)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=tied))
    assert parameter_count(shape, tied) == sum(p.numel() for p in model.parameters())


def test_step_bytes_read_each_weight_once_and_every_rows_keys_and_values():
    """Qwen2.5-0.5B in bf16 holds 12 KiB of keys and values per position (24 layers x 2 x 2 heads x 64 x 2 bytes);
    a step of 64 rows at 600 positions reads them all and every weight once (the tied embedding is the output
    head); untied, the input embedding is read at the batch's rows only."""
    weights, kv = step_bytes(SHAPES["L"], 64, 600, 2)
    assert kv == 64 * 600 * 24 * 2 * 2 * 64 * 2 == 64 * 600 * 12288
    assert weights == 494_032_768 * 2
    untied, _ = step_bytes(SHAPES["L"], 64, 600, 2, tied=False)
    assert untied == (494_032_768 + 64 * 896) * 2  # the output head whole, the embedding's 64 rows
