"""The padding-free forward (a micro-batch's rows concatenated, attention kept to each row and, with shared prompts,
to its prompt) gives the padded forward's log-probs, entropies, values and every gradient.

References are independent of the code under test: the plain padded forward, and attention written out as float64
loops (including stand-ins with the exact signature of each torch release's varlen kernel)."""

from __future__ import annotations

import pytest
import torch

from forward_cases import packed_case, relative, shared_case, sliding_window_model
from posttrain.models.load import enable_checkpointing, load_causal_lm
from posttrain.models.logprobs import response_logprobs
from posttrain.models.policy import PolicyModel
from posttrain.models import shared_prompt
from posttrain.models.shared_prompt import ATTENTION_NAME, prompt_groups

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype,checkpointing", [(torch.float32, False), (torch.float32, True),
                                                 (torch.float64, False)])
def test_packed_logprobs_entropies_and_gradients_equal_the_padded_forward(tiny_model_dir, dtype, checkpointing):
    """Log-probs, entropies and every parameter's gradient of the padding-free forward are the padded forward's."""
    lm = load_causal_lm(str(tiny_model_dir)).to(dtype)
    if checkpointing:
        enable_checkpointing(lm)
    lm.train()
    ids, mask, L, response_mask = packed_case(lm.config.vocab_size)
    lp1, e1 = assert_packed_equals_padded(lm, ids, mask, L, response_mask.to(dtype))
    real = mask[:, -L:].bool()
    assert not lp1[~real].any() and not e1[~real].any()  # response padding: 0, as the padded path gives


def assert_packed_equals_padded(lm, ids, mask, L, weights, prompts=None):
    """The packed forward's (`prompts` shared when given) log-probs, entropies on real tokens and every gradient of
    a loss weighting them equal the padded plain forward's (1e-5 relative); returns the packed log-probs and
    entropies."""
    weights = weights * torch.linspace(-1, 1, L, dtype=weights.dtype)
    results = []
    for packed in (False, True):
        lm.zero_grad()
        lm.config._attn_implementation = ATTENTION_NAME if packed else "sdpa"
        logp, ent = response_logprobs(lm, ids, mask, L, packed=packed, prompts=prompts if packed else None)
        ((logp * weights).sum() + 0.3 * (ent * weights).sum()).backward()
        results.append((logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in lm.named_parameters()}))
    (lp0, e0, g0), (lp1, e1, g1) = results
    real = mask[:, -L:].bool()
    torch.testing.assert_close(lp1[real], lp0[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1[real], e0[real], rtol=1e-5, atol=1e-6)
    for k in g0:
        assert relative(g1[k], g0[k]) < 1e-5, k
    return lp1, e1


def test_packed_attention_keeps_each_row_to_itself(tiny_model_dir):
    """A row's log-probs do not depend on the rows packed beside it (no attention across rows)."""
    lm = load_causal_lm(str(tiny_model_dir))
    lm.config._attn_implementation = ATTENTION_NAME
    ids, mask, L, _ = packed_case(lm.config.vocab_size)
    with torch.no_grad():
        together, _ = response_logprobs(lm, ids, mask, L, packed=True)
        alone = torch.cat([response_logprobs(lm, ids[i:i + 1], mask[i:i + 1], L, packed=True)[0]
                           for i in range(len(ids))])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


def _varlen_by_loops(q, k, v, starts, scale, causal, grouped):
    """What Flash's varlen kernel computes, written out: (N, H, D) rows cut at `starts`, token t of a row reading
    its row's keys up to itself (all of them without `causal`); query head h reads key head h // (H / Hk), which a
    kernel without `enable_gqa` refuses."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads and not grouped:
        raise RuntimeError("fewer key/value heads than query heads without enable_gqa")
    bounds, tokens = starts.tolist(), []
    for s, e in zip(bounds[:-1], bounds[1:]):
        for t in range(s, e):
            end, per_head = (t + 1 if causal else e), []
            for h in range(heads):
                kh = h // (heads // kv_heads)
                per_head.append(torch.softmax(k[s:end, kh] @ q[t, h] * scale, dim=0) @ v[s:end, kh])
            tokens.append(torch.stack(per_head))
    return torch.stack(tokens)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert cu_seq_q.dtype == torch.int32 and cu_seq_q is cu_seq_k and max_q == max_k
    return _varlen_by_loops(query, key, value, cu_seq_q, query.shape[-1] ** -0.5, is_causal, False)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    assert window_size in ((-1, -1), (-1, 0)) and max_q == max_k
    return _varlen_by_loops(query, key, value, cu_seq_q, query.shape[-1] ** -0.5 if scale is None else scale,
                            window_size == (-1, 0), False)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert window_size in ((-1, -1), (-1, 0)) and max_q == max_k
    return _varlen_by_loops(query, key, value, cu_seq_q, query.shape[-1] ** -0.5 if scale is None else scale,
                            window_size == (-1, 0), enable_gqa)


@pytest.mark.parametrize("scaling", [None, 0.5, 0.25])
@pytest.mark.parametrize("kernel", [varlen_2_10, varlen_2_11, varlen_2_13], ids=["torch2.10", "torch2.11", "torch2.13"])
def test_packed_attention_calls_each_torch_releases_varlen_kernel_with_the_keywords_it_takes(kernel, scaling,
                                                                                              monkeypatch):
    """The CUDA half-precision path hands torch's varlen kernel the rows, the causal mask, the scale and the
    grouped heads in whichever keywords the installed release takes (2.10: `is_causal`, no scale; 2.11: `scale`,
    `window_size`, no grouped heads; 2.13: `enable_gqa`): outputs and gradients equal the per-row path's. Each
    stand-in has its release's signature and computes the kernel's sum written out."""
    import inspect

    from posttrain.models import packed

    lengths = [3, 1, 5, 2]
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    packing = packed.Packing(torch.tensor(bounds, dtype=torch.int32), bounds, max(lengths))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, bounds[-1], 4, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    weight = torch.randn(bounds[-1], 4, 4, generator=g, dtype=torch.float64)
    keywords, results = frozenset(inspect.signature(kernel).parameters), []
    for varlen in (False, True):
        if varlen:
            monkeypatch.setattr(packed, "uses_varlen", lambda query, dropout: True)
            monkeypatch.setattr(packed, "varlen_kernel", lambda: (kernel, keywords))
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = packed.attention(None, *inputs, packing, scaling=scaling)[0][0]
        (out * weight).sum().backward()
        results.append([out.detach()] + [x.grad for x in inputs])
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_installed_torchs_varlen_kernel_takes_keywords_the_packed_path_knows():
    from posttrain.models.packed import varlen_kernel

    found = varlen_kernel()
    if found is None:
        pytest.skip("this torch has no varlen attention (before 2.10)")
    keywords = found[1]
    assert {"window_size", "is_causal"} & keywords and {"cu_seq_q", "cu_seq_k", "max_q", "max_k"} <= keywords


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_half_precision_on_cuda_runs_the_varlen_kernel_as_close_as_the_padded_forward(tiny_model_dir, dtype,
                                                                                              monkeypatch):
    """On a GPU in half precision the packed forward runs torch's varlen kernel; its log-probs and gradients are
    as close to a float64 forward as the padded half-precision forward's (rounding differs, so both are measured
    against float64, the packed error at most twice the padded one plus a floor)."""
    from posttrain.models import packed

    calls = []
    kernel = packed.varlen_kernel()
    assert kernel is not None, "a CUDA torch without varlen attention"
    monkeypatch.setattr(packed, "varlen_kernel", lambda: (lambda *a, **kw: calls.append(1) or kernel[0](*a, **kw),
                                                          kernel[1]))
    cuda = torch.device("cuda")
    reference = load_causal_lm(str(tiny_model_dir)).to(cuda, torch.float64).train()
    ids, mask, L, response_mask = packed_case(reference.config.vocab_size)
    ids, mask = ids.to(cuda), mask.to(cuda)
    weights = response_mask.to(cuda, torch.float64) * torch.linspace(-1, 1, L, dtype=torch.float64, device=cuda)
    results = {}
    for name, model_dtype, packed_call in (("float64", torch.float64, False), ("padded", dtype, False),
                                          ("packed", dtype, True)):
        lm = load_causal_lm(str(tiny_model_dir)).to(cuda, model_dtype).train()
        lm.config._attn_implementation = ATTENTION_NAME if packed_call else "sdpa"
        logp, _ = response_logprobs(lm, ids, mask, L, packed=packed_call)
        (logp.double() * weights).sum().backward()
        results[name] = (logp.double().detach(), torch.cat([p.grad.double().flatten() for p in lm.parameters()]))
    assert calls, "the packed half-precision forward did not run the varlen kernel"
    for part, (packed_error, padded_error) in enumerate(_errors_against_float64(results, mask[:, -L:].bool())):
        assert packed_error <= 2 * padded_error + 1e-3, (part, packed_error, padded_error)


def _errors_against_float64(results: dict, real: torch.Tensor) -> list[tuple[float, float]]:
    """For the log-probs (on `real` tokens) and the gradients: the relative error of the "packed" and the "padded"
    results against the "float64" ones (each result a pair of log-probs and flattened gradients)."""
    errors = []
    for part in (0, 1):
        pick = (lambda x: x[real]) if part == 0 else (lambda x: x)
        want = pick(results["float64"][part])
        errors.append((relative(pick(results["packed"][part]), want), relative(pick(results["padded"][part]), want)))
    return errors


def _attention_float64(q, k, v, mask):
    """Attention written out in float64: per batch row and query head, softmax(q k^T / sqrt(d)) over the allowed
    keys, then the weighted sum of values (grouped heads: query head h reads key head h // (H / Hk))."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Lq, D = q.shape
    out = torch.zeros(B, H, Lq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kh = h // (H // k.shape[1])
            for i in range(Lq):
                allowed = mask[i]
                scores = (k[b, kh, allowed] @ q[b, h, i]) / D ** 0.5
                weights = torch.exp(scores - scores.max())
                out[b, h, i] = (weights / weights.sum()) @ v[b, kh, allowed]
    return out


def test_cpu_attention_under_bf16_autocast_computes_in_float32_and_float32_is_untouched():
    """On a CPU, bf16 attention (bf16 inputs, or float32 queries under bf16 autocast as rotary embeddings leave them)
    is computed in float32 and returned in bf16: output and gradients within bf16's rounding of a float64
    re-derivation, no further off than torch's own bf16 kernel. Float32 without autocast is sdpa itself, bit for
    bit."""
    from posttrain.models.packed import sdpa

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g),
               torch.randn(2, 2, 9, 8, generator=g))
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)  # 4 prompt keys, then causal
    weights = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    (_attention_float64(*leaves, mask) * weights).sum().backward()
    want, want_grads = _attention_float64(q, k, v, mask), [x.grad for x in leaves]

    def run(fn):
        leaves = [q.clone().requires_grad_(), k.bfloat16().requires_grad_(), v.bfloat16().requires_grad_()]
        with torch.autocast("cpu", torch.bfloat16):
            out = fn(*leaves, attn_mask=mask, enable_gqa=True)
        (out.double() * weights).sum().backward()
        return out.detach(), [x.grad.double() for x in leaves]

    out, grads = run(sdpa)
    bf16_out, bf16_grads = run(torch.nn.functional.scaled_dot_product_attention)
    assert out.dtype == torch.bfloat16 == bf16_out.dtype
    in_float32 = torch.nn.functional.scaled_dot_product_attention(q, k.bfloat16().float(), v.bfloat16().float(),
                                                                  attn_mask=mask, enable_gqa=True)
    assert torch.equal(out, in_float32.bfloat16())
    assert relative(out.double(), want) < 4e-3  # bf16 keeps 8 bits: relative rounding <= 2^-9 per element
    assert relative(out.double(), want) <= relative(bf16_out.double(), want) + 1e-4
    for grad, bf16_grad, expected in zip(grads, bf16_grads, want_grads):
        assert relative(grad, expected) < 1e-2
        assert relative(grad, expected) <= relative(bf16_grad, expected) + 1e-3

    fp32 = [x.clone().requires_grad_() for x in (q, k, v)]
    ours = sdpa(*fp32, attn_mask=mask, enable_gqa=True)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)


def test_packed_forward_under_bf16_autocast_on_cpu_is_as_close_to_float64_as_the_padded_one(tiny_model_dir):
    """A CPU training forward under bf16 autocast: the packed path (its attention in float32) gives log-probs and
    gradients at least as close to a float64 forward as the padded bf16 forward (transformers' sdpa in bf16), and
    within the documented tolerance: log-probs 0.2%, gradients 2% (relative norm; bf16 keeps 8 significant bits,
    0.4% a rounding)."""
    reference = load_causal_lm(str(tiny_model_dir))
    ids, mask, L, response_mask = packed_case(reference.config.vocab_size)
    weights = response_mask.to(torch.float64) * torch.linspace(-1, 1, L, dtype=torch.float64)
    results = {}
    for name, dtype, packed_call in (("float64", torch.float64, False), ("padded", torch.bfloat16, False),
                                     ("packed", torch.bfloat16, True)):
        lm = load_causal_lm(str(tiny_model_dir)).to(torch.float64 if dtype == torch.float64 else torch.float32)
        lm.train()
        lm.config._attn_implementation = ATTENTION_NAME if packed_call else "sdpa"
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            logp, _ = response_logprobs(lm, ids, mask, L, packed=packed_call)
        (logp.double() * weights).sum().backward()
        results[name] = (logp.double().detach(), torch.cat([p.grad.double().flatten() for p in lm.parameters()]))
    for part, (packed_error, padded_error) in enumerate(_errors_against_float64(results, mask[:, -L:].bool())):
        assert packed_error <= 1.5 * padded_error + 1e-3, (part, packed_error, padded_error)
        assert packed_error < (2e-3, 2e-2)[part], (part, packed_error)  # docs/performance.md's bf16 tolerance


def _elements_written_by_backward(loss: torch.Tensor) -> int:
    """How many tensor elements the ops of `loss`'s backward pass produce (zero-filled gradients included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.total += sum(o.numel() for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor))
            return out

    with Count():
        loss.backward()
    return Count.total


def _attention_after_prompt_by_loops(q, k, v, pk, pv, bounds, prompt_bounds, row_prompt, scale):
    """Each response token's attention written out: its prompt's keys, then its own row's up to itself; query head
    h reads key head h // (H / Hk)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[2], heads, q.shape[3], dtype=q.dtype)
    rows = []
    for row, prompt in enumerate(row_prompt):
        ps, pe = prompt_bounds[prompt], prompt_bounds[prompt + 1]
        for t in range(bounds[row], bounds[row + 1]):
            tokens = []
            for h in range(heads):
                kh = h // (heads // kv_heads)
                keys = torch.cat([pk[0, kh, ps:pe], k[0, kh, bounds[row]:t + 1]])
                values = torch.cat([pv[0, kh, ps:pe], v[0, kh, bounds[row]:t + 1]])
                weights = torch.softmax(keys @ q[0, h, t] * scale, dim=0)
                tokens.append(weights @ values)
            rows.append((t, torch.stack(tokens)))
    return torch.stack([o for _, o in sorted(rows, key=lambda x: x[0])]) if rows else out


@pytest.mark.parametrize("case", ["uneven, out of prompt order, an empty row", "equal rows in prompt order"])
def test_responses_after_their_prompt_equal_the_attention_written_out(case):
    """Responses grouped by prompt and padded in one sdpa call per prompt: outputs and the gradients of every
    input (the prompt's keys and values get each sharer's) equal a per-token float64 loop."""
    from posttrain.models.packed import Packing, attention_after_prompt

    if case.startswith("uneven"):
        lengths, row_prompt, prompt_lengths = [3, 1, 4, 0, 2, 2, 5], [0, 2, 0, 1, 2, 2, 1], [2, 5, 3]
    else:
        lengths, row_prompt, prompt_lengths = [3, 3, 3, 3], [0, 0, 1, 1], [4, 2]
    bounds = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    prompt_bounds = [sum(prompt_lengths[:i]) for i in range(len(prompt_lengths) + 1)]
    packing = Packing(torch.tensor(bounds, dtype=torch.int32), bounds, max(lengths))
    prompts = Packing(torch.tensor(prompt_bounds, dtype=torch.int32), prompt_bounds, max(prompt_lengths))
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, bounds[-1], 4, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    pk, pv = (torch.randn(1, 2, prompt_bounds[-1], 4, generator=g, dtype=torch.float64) for _ in range(2))
    weight = torch.randn(bounds[-1], 4, 4, generator=g, dtype=torch.float64)
    grads = []
    for run in ("code", "loops"):
        inputs = [x.clone().requires_grad_() for x in (q, k, v, pk, pv)]
        if run == "code":
            out = attention_after_prompt(*inputs, prompts, packing, row_prompt, scaling=0.5)[0][0]
        else:
            out = _attention_after_prompt_by_loops(*inputs, bounds, prompt_bounds, row_prompt, 0.5)
        (out * weight).sum().backward()
        grads.append([out.detach()] + [x.grad for x in inputs])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_packed_attention_backward_work_grows_linearly_with_the_rows():
    """The backward pass of packed attention (each row alone, and responses after their shared prompts) writes a
    bounded number of elements per packed token: no row's gradient spans the whole packed row (which, summed over
    the rows, would grow with rows x tokens)."""
    from posttrain.models.packed import Packing, attention, attention_after_prompt

    def case(rows: int):
        g = torch.Generator().manual_seed(0)
        length, prompt_length, sharers = 4, 3, 2
        bounds = [i * length for i in range(rows + 1)]
        prompt_bounds = [i * prompt_length for i in range(rows // sharers + 1)]
        packing = Packing(torch.tensor(bounds, dtype=torch.int32), bounds, length)
        prompts = Packing(torch.tensor(prompt_bounds, dtype=torch.int32), prompt_bounds, prompt_length)
        q, k, v = (torch.randn(1, h, bounds[-1], 8, generator=g, requires_grad=True) for h in (4, 2, 2))
        pk, pv = (torch.randn(1, 2, prompt_bounds[-1], 8, generator=g, requires_grad=True) for _ in range(2))
        own = _elements_written_by_backward(attention(None, q, k, v, packing)[0].sum())
        after = _elements_written_by_backward(attention_after_prompt(
            q, k, v, pk, pv, prompts, packing, [r // sharers for r in range(rows)])[0].sum())
        return own, after

    (own_8, after_8), (own_64, after_64) = case(8), case(64)
    assert own_64 < 8 * own_8 * 1.5 and after_64 < 8 * after_8 * 1.5, (own_8, own_64, after_8, after_64)


def test_policy_model_packs_rows_and_shares_prompts_after_its_checks(tiny_model_dir):
    model = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    ids, mask, L, uids = shared_case(model.config.vocab_size)
    with torch.no_grad():
        plain, _ = model(ids, mask, L, with_entropy=False)
        packed, _ = model(ids, mask, L, with_entropy=False, prompts=prompt_groups(uids), packed=True)
    assert model.packed_ok is True and model.shared_prompt_ok is True
    real = mask[:, -L:].bool()
    torch.testing.assert_close(packed[real], plain[real], rtol=1e-5, atol=1e-6)


def test_policy_model_keeps_padded_rows_for_a_sliding_window_model(tiny_tokenizer):
    model = PolicyModel(sliding_window_model())
    ids, mask, L, _ = packed_case(64)
    out, _ = model(ids, mask, L, packed=True)
    assert model.packed_ok is False and out.shape == (len(ids), L)
    assert model.config._attn_implementation != ATTENTION_NAME


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_values_and_gradients_equal_the_padded_forward(tiny_model_dir, dtype):
    from posttrain.models.policy import ValueModel

    torch.manual_seed(0)
    model = ValueModel.from_pretrained(str(tiny_model_dir)).to(dtype)
    model.train()
    ids, mask, L, response_mask = packed_case(model.backbone.config.vocab_size)
    weights = response_mask.to(dtype) * torch.linspace(-1, 1, L, dtype=dtype)
    results = []
    for packed in (False, True):
        model.zero_grad()
        model.backbone.config._attn_implementation = ATTENTION_NAME if packed else "sdpa"
        values = model._packed_values(ids, mask, L) if packed else model(ids, mask, L)
        (values * weights).sum().backward()
        results.append((values.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (v0, g0), (v1, g1) = results
    real = mask[:, -L:].bool()
    torch.testing.assert_close(v1[real], v0[real], rtol=1e-5, atol=1e-6)
    for k in g0:
        assert relative(g1[k], g0[k]) < 1e-5, k
    model.packed_ok = None
    assert model.packs()


@pytest.mark.parametrize("checkpointing,grouped_heads,dtype", [(False, True, torch.float32), (True, True, torch.float32),
                                                               (False, False, torch.float32),
                                                               (False, True, torch.float64)])
def test_packed_shared_prompt_logprobs_and_gradients_equal_the_padded_forward(tiny_model_dir, checkpointing,
                                                                               grouped_heads, dtype, monkeypatch):
    """Prompts packed and computed once, responses packed after them: the padded plain forward's log-probs,
    entropies and gradients (1e-5 relative)."""
    monkeypatch.setattr(shared_prompt, "grouped_heads_in_sdpa", lambda keys: grouped_heads)
    lm = load_causal_lm(str(tiny_model_dir)).to(dtype)
    if checkpointing:
        enable_checkpointing(lm)
    lm.train()
    ids, mask, L, uids = shared_case(lm.config.vocab_size)
    assert_packed_equals_padded(lm, ids, mask, L, mask[:, -L:].to(dtype), prompts=prompt_groups(uids))


def test_value_model_packs_shared_prompts_with_the_padded_values_and_gradients(tiny_model_dir):
    from posttrain.models.policy import ValueModel

    torch.manual_seed(0)
    model = ValueModel.from_pretrained(str(tiny_model_dir)).double()
    ids, mask, L, uids = shared_case(model.backbone.config.vocab_size)
    weights = mask[:, -L:].double() * torch.linspace(-1, 1, L, dtype=torch.float64)
    results = []
    for packed in (False, True):
        model.zero_grad()
        values = model(ids, mask, L, prompts=prompt_groups(uids) if packed else None, packed=packed)
        (values * weights).sum().backward()
        results.append((values.detach() * mask[:, -L:], {k: p.grad.clone() for k, p in model.named_parameters()}))
    assert model.packed_ok is True and model.shared_prompt_ok is True
    (v0, g0), (v1, g1) = results
    torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-8)
    for k in g0:
        assert relative(g1[k], g0[k]) < 1e-5, k
