"""Chunked log-probs / entropy against a plain float64 log-softmax, on tensors and on the tiny Qwen2 model."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.models import logprobs
from posttrain.models.logprobs import _chunked, _linear_projection, response_logprobs
from posttrain.models.tiny import build_tiny_model

TEXTS = [f"Question: {i} + {i * 7 % 13} = ?\nAnswer: {i + i * 7 % 13}\n#### {i + i * 7 % 13}" for i in range(120)]
P, L, B = 7, 6, 5


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """Unchunked float64 log-prob of labels and entropy: log_softmax, gather, logsumexp - sum softmax * z."""
    z = logits.double() / temperature
    logp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    return logp, entropy


# --------------------------------------------------------------------------------------------- tensor-level


def token_logprobs_and_entropy(hidden, weight, labels, *, temperature=1.0, chunk_size=1024, with_entropy=True,
                               lm_head_bias=None):
    """The chunked core of `response_logprobs` on plain tensors: hidden (N, H) through an output head (V, H)."""
    params = [weight] + ([lm_head_bias] if lm_head_bias is not None else [])
    return _chunked(hidden, labels, _linear_projection(weight, lm_head_bias), params, temperature=temperature,
                    chunk_size=chunk_size, with_entropy=with_entropy)


def _tensors(n=23, h=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
def test_tensor_level_matches_reference(chunk_size, temperature):
    hidden, weight, labels = _tensors()
    logp, ent = token_logprobs_and_entropy(hidden, weight, labels, temperature=temperature, chunk_size=chunk_size)
    ref_lp, ref_ent = reference(hidden.double() @ weight.double().T, labels, temperature)
    assert logp.dtype == torch.float32 and logp.shape == labels.shape
    torch.testing.assert_close(logp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    lp_only, none = token_logprobs_and_entropy(hidden, weight, labels, temperature=temperature,
                                               chunk_size=chunk_size, with_entropy=False)
    assert none is None and torch.equal(lp_only, logp)


def test_tensor_level_bias_and_empty():
    hidden, weight, labels = _tensors()
    bias = torch.randn(weight.shape[0])
    logp, ent = token_logprobs_and_entropy(hidden, weight, labels, lm_head_bias=bias, chunk_size=4)
    ref_lp, ref_ent = reference(hidden.double() @ weight.double().T + bias.double(), labels)
    torch.testing.assert_close(logp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    lp0, ent0 = token_logprobs_and_entropy(hidden[:0], weight, labels[:0])
    assert lp0.shape == (0,) and ent0.shape == (0,)


def test_tensor_level_gradients_match_unchunked():
    hidden, weight, labels = _tensors()
    coef = torch.randn(hidden.shape[0], dtype=torch.float64)
    grads = []
    for chunked in (True, False):
        h, w = hidden.double().requires_grad_(), weight.double().requires_grad_()
        if chunked:
            logp, ent = token_logprobs_and_entropy(h, w, labels, temperature=0.8, chunk_size=5)
        else:
            logp, ent = reference(h @ w.T, labels, temperature=0.8)
        ((logp * coef).sum() + 0.3 * ent.sum()).backward()
        grads.append((h.grad, w.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b.to(a.dtype), atol=1e-5, rtol=1e-5)


def test_backward_keeps_no_full_logits(monkeypatch):
    """With grad on and logits over the budget, no (rows, V) tensor is saved for backward: each chunk is recomputed
    under checkpoint."""
    monkeypatch.setattr(logprobs, "KEPT_LOGITS_BYTES", 40 * 50 * 4 - 1)
    hidden, weight, labels = _tensors(n=40, h=16, v=50)
    hidden.requires_grad_()
    weight.requires_grad_()
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = token_logprobs_and_entropy(hidden, weight, labels, chunk_size=8)
    assert saved, "expected checkpoint to save its inputs"
    assert all(not (len(s) == 2 and s[-1] == 50) for s in saved), saved
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(weight.grad).all() and hidden.grad.abs().sum() > 0


def test_logits_within_the_budget_are_kept_not_recomputed(monkeypatch):
    """Under the budget each chunk's logits are projected once (the backward pass reuses them); over it, twice.
    Both give the unchunked float64 gradients."""
    hidden, weight, labels = _tensors(n=40, h=16, v=50)
    coef = torch.linspace(-1, 1, 40, dtype=torch.float64)
    h64 = hidden.double().requires_grad_()
    lp, ent = reference(h64 @ weight.double().T, labels)
    ((lp * coef).sum() + 0.3 * ent.sum()).backward()
    for budget, projections in ((40 * 50 * 4, 5), (40 * 50 * 4 - 1, 10)):
        monkeypatch.setattr(logprobs, "KEPT_LOGITS_BYTES", budget)
        calls = []
        project = _linear_projection(weight, None)
        h = hidden.clone().requires_grad_()
        logp, ent = _chunked(h, labels, lambda x: calls.append(1) or project(x), [weight], temperature=1.0,
                             chunk_size=8, with_entropy=True)
        ((logp * coef.float()).sum() + 0.3 * ent.sum()).backward()
        assert len(calls) == projections, (budget, len(calls))
        torch.testing.assert_close(h.grad.double(), h64.grad, atol=1e-5, rtol=1e-5)


def test_label_log_prob_gradient_is_one_hot_minus_softmax():
    """The fused log-prob's backward against the derivative written out: d logp_y / dz = onehot(y) - softmax(z),
    d lse / dz = softmax(z), each weighted by its own upstream gradient (one or both may be absent)."""
    from posttrain.models.logprobs import _LabelLogProb

    g = torch.Generator().manual_seed(3)
    z0 = torch.randn(6, 9, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 9, (6,), generator=g)
    a, b = torch.randn(6, dtype=torch.float64, generator=g), torch.randn(6, dtype=torch.float64, generator=g)
    for use_logp, use_lse in ((True, True), (True, False), (False, True)):
        z = z0.clone().requires_grad_()
        logp, lse = _LabelLogProb.apply(z, labels)
        loss = (a * logp).sum() * use_logp + (b * lse).sum() * use_lse
        loss.backward()
        expected = torch.zeros_like(z0)
        for i in range(6):
            for v in range(9):
                p = torch.exp(z0[i, v]) / torch.exp(z0[i]).sum()
                expected[i, v] = use_logp * a[i] * (float(v == labels[i]) - p) + use_lse * b[i] * p
        torch.testing.assert_close(z.grad, expected)
        torch.testing.assert_close(logp, torch.log_softmax(z0, -1)[torch.arange(6), labels])


def test_bf16_autocast_close():
    hidden, weight, labels = _tensors()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = token_logprobs_and_entropy(hidden, weight, labels, chunk_size=6)
    assert logp.dtype == torch.float32
    ref_lp, ref_ent = reference(hidden.double() @ weight.double().T, labels)
    assert (logp.double() - ref_lp).abs().max() < 0.15
    assert (ent.double() - ref_ent).abs().max() < 0.15


# ---------------------------------------------------------------------------------------------- model-level


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lp") / "m", TEXTS, vocab_size=320, hidden_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture()
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _batch(vocab: int, seed: int = 0):
    """prompt (left-padded, length P) || response (right-padded, length L), with at least one token each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + L), generator=g)
    mask = torch.ones(B, P + L, dtype=torch.long)
    for i in range(B):
        left = int(torch.randint(0, P, (1,), generator=g))  # prompt keeps >= 1 token
        right = int(torch.randint(0, L, (1,), generator=g))  # response keeps >= 1 token
        mask[i, :left] = 0
        mask[i, P + L - right :] = 0
    mask[0, :] = 1  # one unpadded row
    mask[1, P + 1 :] = 0  # one response of a single token
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _model_reference(model, ids, mask, temperature=1.0):
    """float64 copy of the model, full logits, plain log_softmax over the rows that predict the response."""
    m64 = copy.deepcopy(model).double()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = m64(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return reference(logits[:, P - 1 : -1], ids[:, P:], temperature)


def _assert_matches_model_reference(model, seed: int, chunk_size: int = 3):
    """response_logprobs of ``model`` on a random batch equals the float64 full-logits reference on real positions."""
    ids, mask = _batch(96, seed=seed)
    valid = mask[:, P:].bool()
    ref_lp, ref_ent = _model_reference(model, ids, mask)
    with torch.no_grad():
        logp, ent = response_logprobs(model, ids, mask, L, chunk_size=chunk_size)
    assert (logp.double() - ref_lp)[valid].abs().max() < 1e-4
    assert (ent.double() - ref_ent)[valid].abs().max() < 1e-4


def test_response_logprobs_matches_float64_reference(model):
    ids, mask = _batch(model.config.vocab_size)
    valid = mask[:, P:].bool()
    ref_lp, ref_ent = _model_reference(model, ids, mask)
    results = []
    for chunk_size in (1, 7, 1024):
        with torch.no_grad():
            logp, ent = response_logprobs(model, ids, mask, L, chunk_size=chunk_size)
        assert logp.shape == ent.shape == (B, L) and logp.dtype == torch.float32
        assert (logp.double() - ref_lp)[valid].abs().max() < 1e-4
        assert (ent.double() - ref_ent)[valid].abs().max() < 1e-4
        assert (logp[~valid] == 0).all() and (ent[~valid] == 0).all()
        results.append((logp, ent))
    for lp, en in results[1:]:
        torch.testing.assert_close(lp, results[0][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(en, results[0][1], atol=1e-5, rtol=0)
    lp_only, none = response_logprobs(model, ids, mask, L, with_entropy=False)
    assert none is None and (lp_only - results[0][0]).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [0.6, 1.5])
def test_response_logprobs_temperature(model, temperature):
    ids, mask = _batch(model.config.vocab_size, seed=1)
    valid = mask[:, P:].bool()
    ref_lp, ref_ent = _model_reference(model, ids, mask, temperature)
    with torch.no_grad():
        logp, ent = response_logprobs(model, ids, mask, L, temperature=temperature, chunk_size=5)
        plain, _ = response_logprobs(model, ids, mask, L)
    assert (logp.double() - ref_lp)[valid].abs().max() < 1e-4
    assert (ent.double() - ref_ent)[valid].abs().max() < 1e-4
    assert (logp - plain)[valid].abs().max() > 1e-3


def test_response_logprobs_gradient_matches_unchunked(model):
    ids, mask = _batch(model.config.vocab_size, seed=2)
    valid = mask[:, P:].double()
    coef = torch.randn(B, L, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    params = {"embed": model.model.embed_tokens.weight, "q": model.model.layers[0].self_attn.q_proj.weight,
              "norm": model.model.norm.weight}

    def loss_of(logp, ent):
        return ((logp.double() * coef + 0.1 * ent.double()) * valid).sum()

    model.zero_grad()
    loss_of(*response_logprobs(model, ids, mask, L, temperature=0.9, chunk_size=3)).backward()
    chunked = {k: p.grad.clone() for k, p in params.items()}
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    loss_of(*reference(logits[:, P - 1 : -1], ids[:, P:], 0.9)).backward()
    for k, p in params.items():
        assert torch.isfinite(chunked[k]).all(), k
        torch.testing.assert_close(chunked[k], p.grad, atol=2e-5, rtol=1e-4, msg=k)


def test_response_logprobs_lm_head_with_bias(model):
    model.config.tie_word_embeddings = False
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.model.embed_tokens.weight)
        head.bias.normal_(0, 1.0)
    model.lm_head = head
    ids, mask = _batch(model.config.vocab_size, seed=4)
    valid = mask[:, P:].bool()
    ref_lp, ref_ent = _model_reference(model, ids, mask)
    logp, ent = response_logprobs(model, ids, mask, L, chunk_size=4)
    assert (logp.double() - ref_lp)[valid].abs().max() < 1e-4
    assert (ent.double() - ref_ent)[valid].abs().max() < 1e-4
    logp.sum().backward()
    assert head.bias.grad is not None and head.bias.grad.abs().sum() > 0


def test_response_logprobs_peft_lora(model):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    ids, mask = _batch(pm.config.vocab_size, seed=5)
    valid = mask[:, P:].bool()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    for adapter_on in (True, False):
        ctx = pm.disable_adapter() if not adapter_on else torch.enable_grad()
        with ctx:
            with torch.no_grad():
                logits = pm(input_ids=ids, attention_mask=mask, position_ids=pos).logits
                logp, ent = response_logprobs(pm, ids, mask, L, chunk_size=4)
            ref_lp, ref_ent = reference(logits[:, P - 1 : -1], ids[:, P:])
            assert (logp.double() - ref_lp)[valid].abs().max() < 1e-4
            assert (ent.double() - ref_ent)[valid].abs().max() < 1e-4
            if adapter_on:
                with_adapter = logp
    assert (with_adapter - logp)[valid].abs().max() > 1e-4  # the adapter changes the log-probs
    logp, _ = response_logprobs(pm, ids, mask, L, chunk_size=4)
    (logp * mask[:, P:]).sum().backward()
    lora_grads = [p.grad for n, p in pm.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    assert all(p.grad is None for n, p in pm.named_parameters() if "lora_" not in n)


def test_response_logprobs_bf16_autocast(model):
    ids, mask = _batch(model.config.vocab_size, seed=6)
    valid = mask[:, P:].bool()
    ref_lp, _ = _model_reference(model, ids, mask)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = response_logprobs(model, ids, mask, L, chunk_size=4)
    assert logp.dtype == torch.float32 and torch.isfinite(ent).all()
    assert (logp.double() - ref_lp)[valid].abs().max() < 0.2


def _tiny(cls_name, cfg_name, **extra):
    import transformers

    cfg = getattr(transformers, cfg_name)(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(cfg).eval()


def test_gemma2_final_logit_softcapping():
    model = _tiny("Gemma2ForCausalLM", "Gemma2Config", final_logit_softcapping=1.5)
    with torch.no_grad():  # make the cap bite: large logits
        model.model.embed_tokens.weight.mul_(30)
    _assert_matches_model_reference(model, seed=7)


def test_absolute_position_model_uses_mask_positions():
    """GPT-2 has learned absolute positions, so left padding must not shift them (RoPE models cannot tell)."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0, 1.0)
    _assert_matches_model_reference(model, seed=9)


def test_unsupported_logit_transform_fails_loudly():
    model = _tiny("CohereForCausalLM", "CohereConfig", logit_scale=0.25)
    ids, mask = _batch(96, seed=8)
    with pytest.raises(ValueError, match="transforms its logits"):
        response_logprobs(model, ids, mask, L)


def test_bad_arguments(model):
    ids, mask = _batch(model.config.vocab_size)
    with pytest.raises(ValueError):
        response_logprobs(model, ids, mask, 0)
    with pytest.raises(ValueError):
        response_logprobs(model, ids, mask, P + L)
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long),
                                   temperature=0.0)


# --------------------------------------------------------------------------------------------- distillation extras


def _model_log_softmax(model, ids, mask):
    m64 = copy.deepcopy(model).double()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = m64(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    return torch.log_softmax(logits[:, P - 1 : -1], -1)


def test_topk_and_given_ids_match_the_full_log_softmax(model):
    """`extra_tokens=k`: the k most likely tokens' log-probs and ids at each response position (a teacher's top-k);
    `extra_tokens=ids`: the log-probs of those ids (the student's on the teacher's top-k), with a gradient; both equal
    the float64 full log-softmax on real positions, 0 on padding, for any chunk size."""
    ids, mask = _batch(model.config.vocab_size)
    valid = mask[:, P:].bool()
    full = _model_log_softmax(model, ids, mask)
    k = 5
    for chunk_size in (1, 7, 1024):
        with torch.no_grad():
            logp, _, (top_lp, top_ids) = response_logprobs(model, ids, mask, L, chunk_size=chunk_size,
                                                           with_entropy=False, extra_tokens=k)
        assert top_lp.shape == top_ids.shape == (B, L, k) and top_ids.dtype == torch.long
        want_lp = full.topk(k, -1).values
        assert (top_lp.double() - want_lp)[valid].abs().max() < 1e-4
        assert (full.gather(-1, top_ids).double() - top_lp.double())[valid].abs().max() < 1e-4
        assert (top_lp[~valid] == 0).all() and (top_ids[~valid] == 0).all()
    given = torch.randint(0, model.config.vocab_size, (B, L, 3), generator=torch.Generator().manual_seed(1))
    logp, ent, at = response_logprobs(model, ids, mask, L, chunk_size=4, extra_tokens=given)
    assert ent is not None and (at.double() - full.gather(-1, given))[valid].abs().max() < 1e-4
    (at * valid.unsqueeze(-1)).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


# --------------------------------------------------------------------------------------------- benchmarks/long_context.py


def test_long_context_benchmark_variants_do_the_same_work():
    """The long-tail benchmark compares like with like: its packed and padded passes split the same rows into
    micro-batches under the same token budget and accumulate the same gradients; the `padded` baseline has as many
    micro-batches as in-order packing under the budget needs, balanced by real tokens, `padded-first-fit` runs the
    packed micro-batches padded, `padded-budgeted` keeps rows x padded width within the budget, `packed-sdpa` is
    packed's (its kernel differs on a GPU only); the lengths follow the stated mix (one row at the tail clip, none
    under 16)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import long_context as bench

    prompt_lens, resp_lens = bench.lengths(12, 1 / 64, seed=1)
    assert max(resp_lens) == 256 and min(resp_lens) >= 16 and all(1 <= p <= 2 for p in prompt_lens)
    grads = {}
    packed_parts = bench.parts_of("packed", prompt_lens, resp_lens, 300, 4)
    assert bench.parts_of("padded-first-fit", prompt_lens, resp_lens, 300, 4) == packed_parts
    assert bench.parts_of("packed-sdpa", prompt_lens, resp_lens, 300, 4) == packed_parts
    for part in packed_parts:
        assert len(part) == 1 or sum(prompt_lens[i] + resp_lens[i] for i in part) <= 300
    tokens = [p + r for p, r in zip(prompt_lens, resp_lens)]
    greedy, used = 1, 0  # micro-batches in-order packing under 300 real tokens needs (a longer row alone)
    for n in tokens:
        if used and used + n > 300:
            greedy, used = greedy + 1, 0
        used += n
    baseline = bench.parts_of("padded", prompt_lens, resp_lens, 300, 4)
    assert len(baseline) == greedy
    sums = sorted(sum(tokens[i] for i in p) for p in baseline)
    assert sums[-1] - sums[0] <= max(tokens)  # balanced by real tokens
    for part in bench.parts_of("padded-budgeted", prompt_lens, resp_lens, 300, 4):
        width = max(prompt_lens[i] for i in part) + max(resp_lens[i] for i in part)
        assert len(part) == 1 or len(part) * width <= 300
    for variant in bench.VARIANTS:
        parts = bench.parts_of(variant, prompt_lens, resp_lens, 300, 4)
        assert sorted(i for p in parts for i in p) == list(range(12))
        model = bench.model_m(512)
        model.model.layers = model.model.layers[:1]
        bench.train_pass(model, prompt_lens, resp_lens, parts, packed=variant.startswith("packed"))
        grads[variant] = [p.grad.clone() for p in model.parameters()]
    for variant in bench.VARIANTS[1:]:
        for a, b in zip(grads["packed"], grads[variant]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)
