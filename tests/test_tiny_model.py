"""The offline tiny model: tokenizer round trips, reload parity through AutoTokenizer, and a loadable model."""

from __future__ import annotations

import filecmp

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding

from posttrain.models.tiny import CHAT_TEMPLATE, build_tiny_model, build_tokenizer

TEXTS = [
    f"Question: Tom has {i} apples and buys {i * 3 + 7} more. How many apples does he have now?\n"
    f"Answer: {i} + {i * 3 + 7} = {4 * i + 7}\n#### {4 * i + 7}"
    for i in range(200)
]
SMALL = dict(vocab_size=384, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)

PROBES = [
    "Tom has 17 apples.",
    "12345 + 67890 = 80235",
    "  two leading spaces and two trailing  ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "it's we'll they've I'M DON'T",
    "héllo wörld — ñ 日本語 🙂",
    "#### 42\n",
    "x" * 50,
    "",
    "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TEXTS, **SMALL)
    return out, build_tokenizer(TEXTS, vocab_size=SMALL["vocab_size"])


def test_special_tokens_and_vocab(built):
    _, tok = built
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|im_end|>", None)
    assert 256 + 3 <= len(tok) <= SMALL["vocab_size"]
    # Special tokens written in text stay single tokens.
    assert tok("<|im_start|>a<|im_end|>")["input_ids"][0] == 1
    assert tok("<|im_start|>a<|im_end|>")["input_ids"][-1] == 2


def test_digits_are_single_tokens(built):
    _, tok = built
    for piece in tok.tokenize("Answer: 1234567890 and 42"):
        if any(c.isdigit() for c in piece):
            assert len(piece) == 1, piece


def test_roundtrip_and_reload_parity(built):
    out, tok = built
    reloaded = AutoTokenizer.from_pretrained(out)
    # transformers 5 reloads a qwen2 dir as Qwen2Tokenizer, which rebuilds the pre-tokenizer from its own code.
    assert type(reloaded).__name__ == "Qwen2Tokenizer"
    assert len(reloaded) == len(tok)
    for text in PROBES:
        ids = tok(text)["input_ids"]
        assert reloaded(text)["input_ids"] == ids, text
        assert tok.decode(ids) == text
        assert reloaded.decode(ids) == text
    batch_a = tok(PROBES, padding=True)["input_ids"]
    batch_b = reloaded(PROBES, padding=True)["input_ids"]
    assert batch_a == batch_b
    assert reloaded.padding_side == "left" and reloaded.pad_token_id == 0 and reloaded.eos_token_id == 2


def test_chat_template(built):
    out, tok = built
    reloaded = AutoTokenizer.from_pretrained(out)
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "What is 12 + 30?"}]
    expected = "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    for t in (tok, reloaded):
        assert t.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == expected
        assert t.apply_chat_template(msgs, tokenize=False) == expected[: -len("<|im_start|>assistant\n")]
        enc = t.apply_chat_template(msgs, add_generation_prompt=True)  # tokenize=True is the default
        assert isinstance(enc, BatchEncoding)
        assert enc["input_ids"] == tok(expected)["input_ids"]
    assert reloaded.decode(tok(expected)["input_ids"], skip_special_tokens=True) == "user\nWhat is 12 + 30?\nassistant\n"


def test_model_loads_and_generates(built):
    out, tok = built
    model = AutoModelForCausalLM.from_pretrained(out)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    assert cfg.vocab_size % 8 == 0 and cfg.vocab_size >= len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (SMALL["hidden_size"], SMALL["num_layers"])
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (2, 0, None)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (2, 0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    prompts = ["What is 3 + 4?", "Tom has 17 apples and buys 5 more. How many apples?"]
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert enc["attention_mask"][0, 0] == 0  # left padding
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=6, do_sample=False)
    T = enc["input_ids"].shape[1]
    assert gen.shape[0] == 2 and T < gen.shape[1] <= T + 6
    assert torch.equal(gen[:, :T], enc["input_ids"])
    assert int(gen.max()) < cfg.vocab_size


def test_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", TEXTS, **SMALL)
    b = build_tiny_model(tmp_path / "b", TEXTS, **SMALL)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                 "model.safetensors"):
        assert filecmp.cmp(a / name, b / name, shallow=False), name
    c = build_tiny_model(tmp_path / "c", TEXTS, **SMALL, seed=1)
    assert filecmp.cmp(a / "tokenizer.json", c / "tokenizer.json", shallow=False)
    assert not filecmp.cmp(a / "model.safetensors", c / "model.safetensors", shallow=False)


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", TEXTS[:20], **SMALL)
    assert torch.equal(torch.rand(3), expected)
