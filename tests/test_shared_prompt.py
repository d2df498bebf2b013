"""Shared-prompt log-probs, entropies, values and gradients (each prompt's keys computed once for its rows) equal
the plain `prompt || response` forward's."""

from __future__ import annotations

import pytest
import torch

from forward_cases import shared_case, sliding_window_model
from posttrain.models.load import enable_checkpointing, load_causal_lm
from posttrain.models.logprobs import response_logprobs
from posttrain.models.policy import PolicyModel
from posttrain.models import shared_prompt
from posttrain.models.shared_prompt import ATTENTION_NAME, prompt_groups


@pytest.mark.parametrize("checkpointing,grouped_heads", [(False, True), (True, True), (False, False)])
def test_shared_prompt_logprobs_and_gradients_equal_the_plain_forward(tiny_model_dir, checkpointing, grouped_heads,
                                                                       monkeypatch):
    """`grouped_heads=False` runs the keys-repeated-per-head form a GPU takes (the tiny model has 2 query heads per
    key/value head)."""
    monkeypatch.setattr(shared_prompt, "grouped_heads_in_sdpa", lambda keys: grouped_heads)
    lm = load_causal_lm(str(tiny_model_dir))
    if checkpointing:
        enable_checkpointing(lm)
    lm.train()
    ids, mask, L, uids = shared_case(lm.config.vocab_size)
    valid = mask[:, -L:].float()
    results = []
    for shared in (False, True):
        lm.zero_grad()
        lm.config._attn_implementation = ATTENTION_NAME if shared else "sdpa"
        if shared:
            logp, ent = response_logprobs(lm, ids, mask, L, prompts=prompt_groups(uids))
        else:
            logp, ent = response_logprobs(lm, ids, mask, L)
        ((logp * valid).sum() + 0.3 * (ent * valid).sum()).backward()
        results.append((logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in lm.named_parameters()}))
    (lp0, e0, g0), (lp1, e1, g1) = results
    assert torch.allclose(lp0, lp1, atol=1e-5) and torch.allclose(e0, e1, atol=1e-5)
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6, rtol=1e-4), k


def test_leading_padding_counts_the_columns_padded_in_every_row_and_keeps_one():
    assert shared_prompt.leading_padding(torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])) == 1
    assert shared_prompt.leading_padding(torch.ones(2, 3, dtype=torch.long)) == 0
    assert shared_prompt.leading_padding(torch.zeros(2, 3, dtype=torch.long)) == 2


def test_grouped_heads_go_to_sdpa_on_a_cpu_only():
    """Elsewhere a mask with grouped heads leaves sdpa only its math kernel, which stores every attention weight."""
    keys = torch.zeros(2, 1, 5, 4)
    assert shared_prompt.grouped_heads_in_sdpa(keys)
    assert not shared_prompt.grouped_heads_in_sdpa(keys.to("meta"))


def test_policy_model_shares_prompts_after_its_check_and_gives_the_same_logprobs(tiny_model_dir):
    model = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    ids, mask, L, uids = shared_case(model.config.vocab_size)
    plain, _ = model(ids, mask, L, with_entropy=False)
    assert model.shared_prompt_ok is None  # no prompt groups given: plain path, no check yet
    shared, _ = model(ids, mask, L, with_entropy=False, prompts=prompt_groups(uids))
    assert model.shared_prompt_ok is True
    assert torch.allclose(plain, shared, atol=1e-5)


def test_policy_model_keeps_the_plain_path_for_a_sliding_window_model(tiny_tokenizer):
    model = PolicyModel(sliding_window_model())
    ids, mask, L, uids = shared_case(64)
    out, _ = model(ids, mask, L, prompts=prompt_groups(uids))
    assert model.shared_prompt_ok is False and out.shape == (len(ids), L)
    assert model.config._attn_implementation != ATTENTION_NAME


def test_value_model_shares_prompts_with_the_same_values_and_gradients(tiny_model_dir):
    from posttrain.models.policy import ValueModel

    torch.manual_seed(0)
    model = ValueModel.from_pretrained(str(tiny_model_dir))
    ids, mask, L, uids = shared_case(model.backbone.config.vocab_size)
    valid = mask[:, -L:].float()
    results = []
    for groups in (None, prompt_groups(uids)):
        model.zero_grad()
        values = model(ids, mask, L, prompts=groups)
        (values * valid * torch.linspace(-1, 1, L)).sum().backward()
        results.append((values.detach() * valid, {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert model.shared_prompt_ok is True
    (v0, g0), (v1, g1) = results
    assert torch.allclose(v0, v1, atol=1e-5)
    assert torch.allclose(model(ids, mask)[:, -(L + 1):-1] * valid, v0, atol=1e-5)  # the full-positions form
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6, rtol=1e-4), k


@pytest.mark.parametrize("computes_in,difference,keeps", [
    ("float32", 1e-3, False), ("float32", 5e-5, True), ("bf16 weights", 1e-3, True), ("bf16 autocast", 1e-3, True),
    ("bf16 weights", 0.1, False)])
def test_the_check_judges_a_fast_path_at_the_precision_its_forward_computes_in(tiny_model_dir, computes_in,
                                                                               difference, keeps):
    """A fast path `difference` off the plain forward: in float32 only rounding (1e-4) is allowed; where the forward
    computes in bf16 — weights cast, as FSDP's mixed precision casts them, or under autocast — two exact kernels
    differ by half precision's rounding (5e-2 allowed), and more than that is still refused."""
    import contextlib

    model = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    if computes_in == "bf16 weights":
        model.to(torch.bfloat16)
    plain = lambda ids, mask, L: response_logprobs(model.lm, ids, mask, L, with_entropy=False)[0]  # noqa: E731
    off = lambda ids, mask, L: plain(ids, mask, L) + difference  # noqa: E731
    autocast = torch.autocast("cpu", torch.bfloat16) if computes_in == "bf16 autocast" else contextlib.nullcontext()
    with autocast:
        kept = shared_prompt.switch_on_if_equal(model, model.lm.config, plain, off, "log-probs", packed=True)
    assert kept is keeps
    assert model.lm.config._attn_implementation == (ATTENTION_NAME if keeps else "sdpa")
