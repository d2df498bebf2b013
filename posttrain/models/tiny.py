"""Offline tiny model + tokenizer factory.

The demo and the tests need a real Hugging Face causal LM without touching the hub. We build a byte-level BPE
tokenizer on local text and a randomly initialised ``Qwen2ForCausalLM``, and save both with ``save_pretrained`` so
that every other part of the library loads them exactly like a downloaded model directory.

Why the tokenizer copies Qwen2's pre-tokenization: in transformers 5 a model directory of type ``qwen2`` reloads its
tokenizer through ``AutoTokenizer`` as ``Qwen2Tokenizer``, which rebuilds the normalizer / pre-tokenizer / decoder
from its own code and only takes vocab + merges from ``tokenizer.json``. Training with the very same pipeline
(NFC, the Qwen2 split regex that isolates every digit, ByteLevel without prefix space) means the reloaded tokenizer
produces identical ids to the in-memory one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                          Qwen2ForSequenceClassification)

__all__ = [
    "CHAT_TEMPLATE",
    "TOOL_CHAT_TEMPLATE",
    "TOOL_TOKENS",
    "PAD_TOKEN",
    "IM_START",
    "IM_END",
    "QWEN2_PRETOKENIZE_REGEX",
    "build_tokenizer",
    "build_tiny_model",
    "build_tiny_reward_model",
    "build_tiny_moe_model",
    "upcycle_to_moe",
    "MOE_ARCHITECTURES",
]

# Same string as transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX: one digit per piece, letters grouped with at most
# one leading non-letter, punctuation runs, newlines, and whitespace.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# Qwen's ChatML, minus the default system prompt (prompts of the tiny model must stay short).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# The hermes tool-call markers, as Qwen2.5 has them: one token each, not special (decoding keeps them).
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# CHAT_TEMPLATE with Qwen2.5's tool layout, kept short for the tiny model's context: the tools go into the system
# turn as one line of signatures (`Tools: calculator(expression)`, no JSON schema), tool results are a user turn
# of <tool_response> blocks (consecutive tool messages share one), and an assistant turn's content is rendered
# verbatim, so the policy's own tool-call text stays as sampled; `tool_calls` fields render as compact
# <tool_call>{"name": ..., "arguments": ...}</tool_call>.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool['function'] if tool['function'] is defined else tool %}"
    "{%- set params = f['parameters']['properties'] if f['parameters'] is defined else {} %}"
    "{{- ' ' + f['name'] + '(' + (params | list | join(', ')) + ')' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set call = call['function'] if call['function'] is defined else call %}"
    "{%- set args = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson %}"
    "{{- '<tool_call>{\"name\": \"' + call['name'] + '\", \"arguments\": ' + args + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def _qwen2_pipeline(tok: Tokenizer) -> None:
    """Install Qwen2's normalizer, pre-tokenizer and decoder on ``tok`` (so a reload as Qwen2Tokenizer matches)."""
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()


def build_tokenizer(texts: Iterable[str], vocab_size: int = 512, extra_special_tokens: Iterable[str] = (), *,
                    tools: bool = False) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` with Qwen2's pre-tokenization and ChatML specials.

    The 256 byte symbols are always in the vocabulary (so any string round-trips); merges learned from ``texts``
    fill the rest up to ``vocab_size``. Ids 0, 1, 2 are ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>``
    (eos); ``extra_special_tokens`` (e.g. a VL model's vision markers) follow them. Training is deterministic for a
    given list of texts. ``tools``: TOOL_CHAT_TEMPLATE, and TOOL_TOKENS added after the learned vocabulary as
    ordinary (not special) tokens, as Qwen2.5 has them.
    """
    texts = list(texts)
    extra = list(extra_special_tokens)
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    _qwen2_pipeline(tok)
    trainer = BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + extra,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        additional_special_tokens=[IM_START, IM_END] + extra,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        padding_side="left",
        chat_template=TOOL_CHAT_TEMPLATE if tools else CHAT_TEMPLATE,
    )
    if tools:
        hf_tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return hf_tok


def build_tiny_model(
    out_dir: str | Path,
    texts: Iterable[str],
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    seed: int = 0,
    tools: bool = False,
) -> Path:
    """Build tokenizer + randomly initialised tied-embedding ``Qwen2ForCausalLM`` and save both into ``out_dir``.

    The embedding matrix is padded to a multiple of 8 (faster matmuls; extra rows are never produced by the
    tokenizer). eos = ``<|im_end|>``, pad = ``<|endoftext|>``, no bos — as in Qwen2.5-Instruct. ``tools``: the
    tokenizer of ``build_tokenizer(tools=True)`` (tool chat template and tool-call tokens). Returns ``out_dir``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size, tools=tools)
    config = _tiny_config(tokenizer, hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                          max_position_embeddings=max_position_embeddings)
    eos_id, pad_id = config.eos_token_id, config.pad_token_id
    # Seed a private generator state so building a model does not disturb (or depend on) the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _mark_tokenizer_class(out)
    return out


def build_tiny_reward_model(out_dir: str | Path, texts: Iterable[str], *, vocab_size: int = 512, hidden_size: int = 64,
                            num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                            max_position_embeddings: int = 512, seed: int = 0) -> Path:
    """A randomly initialised ``Qwen2ForSequenceClassification`` with one label (a scalar reward model, as the
    Skywork / Qwen RMs are) and the tokenizer of ``build_tiny_model``, saved into ``out_dir``: the offline stand-in
    for ``reward_model.model.path`` in tests and examples. Returns ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size)
    config = _tiny_config(tokenizer, hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                          max_position_embeddings=max_position_embeddings, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForSequenceClassification(config)
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores of order 1 (the default init gives ~0.02)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _mark_tokenizer_class(out)
    return out


MOE_ARCHITECTURES = ("qwen2_moe", "qwen3_moe")


def build_tiny_moe_model(out_dir: str | Path, texts: Iterable[str], *, arch: str = "qwen2_moe", vocab_size: int = 512,
                         hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                         num_experts: int = 4, top_k: int = 2, moe_intermediate_size: int = 64,
                         shared_expert_intermediate_size: int = 128, max_position_embeddings: int = 512,
                         seed: int = 0) -> Path:
    """A randomly initialised mixture-of-experts causal LM with the tokenizer of ``build_tiny_model``: ``arch``
    ``qwen2_moe`` (``Qwen2MoeForCausalLM``: routed experts plus a gated shared expert) or ``qwen3_moe``
    (``Qwen3MoeForCausalLM``: routed experts only, top-k weights renormalised). Every decoder layer is sparse.
    The config asks for the router's auxiliary loss in training (``output_router_logits=True``, the model's own
    ``router_aux_loss_coef``), as a fine-tuning config of these models does. Returns ``out_dir``."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if arch not in MOE_ARCHITECTURES:
        raise ValueError(f"arch must be one of {MOE_ARCHITECTURES}, got {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size)
    common = dict(vocab_size=(len(tokenizer) + 7) // 8 * 8, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                  pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), hidden_size=hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, num_experts=num_experts,
                  num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size, decoder_sparse_step=1,
                  intermediate_size=moe_intermediate_size * top_k, output_router_logits=True)
    if arch == "qwen2_moe":
        config, cls = Qwen2MoeConfig(shared_expert_intermediate_size=shared_expert_intermediate_size, **common), \
            Qwen2MoeForCausalLM
    else:
        config, cls = Qwen3MoeConfig(norm_topk_prob=True, head_dim=hidden_size // num_heads, **common), \
            Qwen3MoeForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        for name, param in model.named_parameters():  # the router starts at zero in transformers' init
            if name.endswith("mlp.gate.weight"):
                torch.nn.init.normal_(param, std=config.initializer_range)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _mark_tokenizer_class(out)
    return out


def upcycle_to_moe(dense_dir: str | Path, out_dir: str | Path, *, num_experts: int = 4, top_k: int = 2,
                   seed: int = 0) -> Path:
    """A ``Qwen2MoeForCausalLM`` that computes what the dense Qwen2 model at ``dense_dir`` computes ("sparse
    upcycling"): every expert is a copy of the layer's MLP, the top-k routing weights are renormalised to sum to 1
    (``norm_topk_prob``), and the shared expert's output projection is zero; attention, norms and embeddings are
    copied. The router starts small and random, so training makes the experts diverge. This gives a MoE model with a
    trained starting point (e.g. an SFT warm start) without training one. Returns ``out_dir``."""
    from transformers import AutoTokenizer, Qwen2MoeConfig, Qwen2MoeForCausalLM

    dense = Qwen2ForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    d = dense.config
    config = Qwen2MoeConfig(
        vocab_size=d.vocab_size, tie_word_embeddings=d.tie_word_embeddings, rms_norm_eps=d.rms_norm_eps,
        bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id,
        hidden_size=d.hidden_size, num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, max_position_embeddings=d.max_position_embeddings,
        rope_parameters=d.rope_parameters, num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
        moe_intermediate_size=d.intermediate_size, shared_expert_intermediate_size=d.intermediate_size,
        intermediate_size=d.intermediate_size, decoder_sparse_step=1, output_router_logits=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2MoeForCausalLM(config)
    state = model.state_dict()
    with torch.no_grad():
        for name, value in dense.state_dict().items():
            if ".mlp." not in name:
                state[name].copy_(value)
        for i, layer in enumerate(dense.model.layers):
            moe = model.model.layers[i].mlp
            mlp = layer.mlp
            moe.experts.gate_up_proj.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])[None].expand(
                num_experts, -1, -1))
            moe.experts.down_proj.copy_(mlp.down_proj.weight[None].expand(num_experts, -1, -1))
            moe.shared_expert.load_state_dict(mlp.state_dict())
            moe.shared_expert.down_proj.weight.zero_()
            torch.nn.init.normal_(moe.gate.weight, std=config.initializer_range)
    model.generation_config = dense.generation_config
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(dense_dir).save_pretrained(out)
    _mark_tokenizer_class(out)
    return out


def _tiny_config(tokenizer, **sizes) -> Qwen2Config:
    """Qwen2 config for ``tokenizer``: the embedding matrix padded to a multiple of 8, eos = ``<|im_end|>``,
    pad = ``<|endoftext|>``, no bos."""
    return Qwen2Config(vocab_size=(len(tokenizer) + 7) // 8 * 8, tie_word_embeddings=True, rms_norm_eps=1e-6,
                       bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
                       pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN), **sizes)


def _mark_tokenizer_class(out: Path) -> None:
    """Record ``Qwen2Tokenizer`` as the tokenizer class, the class AutoTokenizer picks for qwen2 dirs anyway.

    Stating it keeps the directory self-describing (like a real Qwen checkpoint) and stops the loader from
    warning about a class mismatch.
    """
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
