"""The fast paths give the plain paths' results: posttrain's decoding engine (shared prompts, finished rows
dropped, its own sampler) and shared-prompt log-probs (values and gradients).

References are independent of the code under test: transformers' own `generate`, transformers' own logits
warpers, the exact probabilities of the model's plain forward, and the plain `prompt || response` forward."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.data.batch import Batch
from posttrain.models.load import enable_checkpointing, load_causal_lm
from posttrain.models.logprobs import response_logprobs
from posttrain.models.policy import PolicyModel
from posttrain.models import shared_prompt
from posttrain.models.shared_prompt import ATTENTION_NAME, prompt_groups
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout import decode_state, prefill
from posttrain.rollout.prefill import prefill_buckets
from posttrain.rollout.transformers_generate import TransformersGenerate
from posttrain.rollout.decode_state import FIRST_CAPACITY
from posttrain.rollout.sampling import next_tokens
from posttrain.rollout.weights import inference_weights

CPU = torch.device("cpu")


def batch_of(tok, texts) -> Batch:
    from posttrain.data.dataset import PromptItem, collate_prompts

    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
             for t in texts]
    items = [PromptItem(chat["input_ids"], "synthetic/arithmetic", "0") for chat in chats]
    ids, mask = collate_prompts(items, tok.pad_token_id)
    return Batch({"prompts": ids, "prompt_mask": mask}, {"uid": [str(i) for i in range(len(texts))]})


TEXTS = ["1+2=", "33+44=", "5+57=", "What is 12 plus 9?", "7+7=", "80+1="]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the decoding loop as it runs on a CPU; its static-buffer loop (what CUDA graphs record) run eagerly on the CPU; and
# the recorded CUDA graphs themselves where a GPU is present
MODES = ["eager", "static", pytest.param("cuda_graphs", marks=CUDA)]


def engine_for(mode, model, tok, monkeypatch, **kwargs) -> DecodeEngine:
    """The engine in `mode`, with a static first capacity of 8 (so that 40 new tokens double it twice) and prompts
    prefilled in as many length buckets as there are (up to 4), however short."""
    monkeypatch.setattr(decode_state, "STATIC_FIRST_CAPACITY", 8)
    monkeypatch.setattr(prefill, "PREFILL_CALL_COST", 0)
    device = torch.device("cuda") if mode == "cuda_graphs" else CPU
    engine = DecodeEngine(model, tok, device=device, **kwargs)
    assert engine.cuda_graphs == (mode == "cuda_graphs")
    engine.static = mode != "eager"
    return engine


# ------------------------------------------------------------------ decoding engine


@pytest.mark.parametrize("mode", MODES)
def test_engine_greedy_equals_transformers_generate_with_finished_rows_dropped(tiny_model_dir, tiny_tokenizer, mode,
                                                                               monkeypatch):
    """Greedy decoding: token for token what `generate` gives, with rows finishing at different steps (so the
    engine drops finished rows mid-way), prompts of different lengths, several prompts per call and n > 1, and
    more new tokens than the first cache capacity (so its buffers grow mid-way)."""
    device = torch.device("cuda") if mode == "cuda_graphs" else CPU
    lm = load_causal_lm(str(tiny_model_dir)).to(device)
    torch.manual_seed(0)
    with torch.no_grad():  # larger random weights: greedy text that depends on the prompt (not one repeated token)
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model = PolicyModel(lm)
    batch = batch_of(tiny_tokenizer, TEXTS)
    plain = TransformersGenerate(model, tiny_tokenizer, device=device, dtype=torch.float32)
    free = plain.generate(batch, SamplingParams(n=1, do_sample=False, max_new_tokens=40, ignore_eos=True))
    stop = set(free["responses"][:3, 2].tolist())  # end tokens: rows then finish at different steps, or never
    fast = engine_for(mode, model, tiny_tokenizer, monkeypatch, dtype=torch.float32, micro_batch_size=4)
    plain.eos_ids = fast.eos_ids = stop
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=40)
    assert greedy.max_new_tokens > FIRST_CAPACITY
    a, b = plain.generate(batch, greedy), fast.generate(batch, greedy)
    assert fast.shared_prefix_ok
    lengths = a["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1, "the test needs rows that finish at different steps"
    assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["response_mask"], b["response_mask"])
    if mode == "cuda_graphs":  # the first capacity, two doublings and at least one compaction, in the last call
        assert fast.cuda_graphs and fast.graphs_recorded >= 4, fast.graphs_recorded


def test_prefill_buckets_cover_every_prompt_once_in_length_order():
    lengths = torch.tensor([62, 49, 86, 73, 42, 83, 73, 138, 150, 92, 118, 119, 57, 91, 42, 89])  # 16 GSM8K prompts
    buckets = prefill_buckets(lengths)
    assert sorted(torch.cat(buckets).tolist()) == list(range(16))
    in_order = lengths[torch.cat(buckets)]
    assert torch.equal(in_order, in_order.sort().values)
    # 2 buckets: 8 x 83 + 8 x 150 positions + 2 calls, against 16 x 150 + 1 call (PREFILL_CALL_COST = 256)
    assert [len(b) for b in buckets] == [8, 8]
    assert len(prefill_buckets(torch.full((16,), 90))) == 1  # nothing to save
    assert len(prefill_buckets(torch.tensor([300] * 8 + [10] * 8))) == 2
    assert [b.tolist() for b in prefill_buckets(torch.tensor([7]))] == [[0]]


def test_bucketed_prefill_gives_the_one_call_prefill(tiny_model_dir, tiny_tokenizer, monkeypatch):
    """Prompts prefilled in length buckets: the same last logits and cached keys / values as one call over the
    padded batch, and zeros on every padded position (which enter the decoding products masked)."""
    model = load_causal_lm(str(tiny_model_dir)).eval()
    batch = batch_of(tiny_tokenizer, ["1+2=", "What is 12 plus 9, and then 30 more?", "5+57=", "Add 4 and 4 and 1."])
    prompts, mask = batch["prompts"], batch["prompt_mask"]
    engine = DecodeEngine(model, tiny_tokenizer, device=CPU, dtype=torch.float32)
    results = {}
    for cost, calls in ((10**9, 1), (0, 4)):
        monkeypatch.setattr(prefill, "PREFILL_CALL_COST", cost)
        assert len(prefill_buckets(mask.sum(-1))) == calls
        with torch.no_grad():
            results[calls] = engine._prefill(model, prompts, mask, 2, 4, False)
    (one_logits, one), (logits, bucketed) = results[1], results[4]
    torch.testing.assert_close(logits, one_logits, rtol=1e-5, atol=1e-5)
    pad = (mask == 0)[:, None, :, None]
    for a, b in zip(one.prefix_keys + one.prefix_values, bucketed.prefix_keys + bucketed.prefix_values):
        torch.testing.assert_close(b.masked_fill(pad, 0), a.masked_fill(pad, 0), rtol=1e-5, atol=1e-5)
        assert not b.masked_select(pad).any()


def test_engine_bf16_greedy_matches_transformers_generate(tiny_model_dir, tiny_tokenizer):
    model = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    batch = batch_of(tiny_tokenizer, TEXTS[:4])
    greedy = SamplingParams(n=3, do_sample=False, max_new_tokens=10, ignore_eos=True)
    a = TransformersGenerate(model, tiny_tokenizer, device=CPU, dtype=torch.bfloat16).generate(batch, greedy)
    b = DecodeEngine(model, tiny_tokenizer, device=CPU, dtype=torch.bfloat16).generate(batch, greedy)
    assert (a["responses"] == b["responses"]).float().mean() > 0.95  # bf16 rounding may flip a near-tie


@pytest.mark.parametrize("mode", ["eager", pytest.param("cuda_graphs", marks=CUDA)])
def test_engine_samples_the_model_distribution(tiny_model_dir, tiny_tokenizer, mode, monkeypatch):
    """4000 two-token samples of one prompt (temperature 0.8, top-k 6, top-p 0.9): the empirical joint
    distribution of (first, second) token against the exact one from the model's plain forward and
    transformers' warpers — chi-square within its 99.9% bound."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    device = torch.device("cuda") if mode == "cuda_graphs" else CPU
    lm = load_causal_lm(str(tiny_model_dir)).to(device).eval()
    model = PolicyModel(lm)
    batch = batch_of(tiny_tokenizer, ["33+44="])
    s = SamplingParams(n=4000, temperature=0.8, top_k=6, top_p=0.9, max_new_tokens=2, ignore_eos=True)
    torch.manual_seed(0)
    out = engine_for(mode, model, tiny_tokenizer, monkeypatch, dtype=torch.float32).generate(batch, s)
    warpers = [TemperatureLogitsWarper(0.8), TopKLogitsWarper(6), TopPLogitsWarper(0.9)]

    def dist(ids):
        with torch.no_grad():
            logits = lm(input_ids=ids.to(device)).logits[:, -1].double().cpu()
        for w in warpers:
            logits = w(ids, logits)
        return torch.softmax(logits, -1)[0]

    prompt = batch["prompts"][:, batch["prompt_mask"][0].bool()]
    p1 = dist(prompt)
    expected = {}
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(torch.cat([prompt, torch.tensor([[t1]])], 1))
        for t2 in p2.nonzero().flatten().tolist():
            expected[(t1, t2)] = float(p1[t1] * p2[t2])
    counts: dict = {}
    for t1, t2 in out["responses"].tolist():
        counts[(t1, t2)] = counts.get((t1, t2), 0) + 1
    assert set(counts) <= set(expected), "a token outside the top-k / top-p set was drawn"
    n = len(out)
    chi2, dof, rest_obs, rest_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        if n * p < 5:
            rest_obs, rest_exp = rest_obs + counts.get(cell, 0), rest_exp + n * p
            continue
        chi2 += (counts.get(cell, 0) - n * p) ** 2 / (n * p)
        dof += 1
    if rest_exp > 0:
        chi2 += (rest_obs - rest_exp) ** 2 / rest_exp
        dof += 1
    assert dof >= 3
    assert chi2 < dof + 3.1 * math.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (5, 1.0, 0.7), (0, 0.6, 1.3), (8, 0.75, 0.9)])
def test_sampler_matches_transformers_warpers(top_k, top_p, temperature):
    """next_tokens on fixed logits: frequencies of 40000 draws vs the probabilities transformers' warpers give."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(1, 30) * 2
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone().double())
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    probs = torch.softmax(warped, -1)[0]
    s = SamplingParams(temperature=temperature, top_k=top_k or -1, top_p=top_p)
    draws = next_tokens(logits.expand(40000, -1), s, torch.Generator().manual_seed(3))
    freq = torch.bincount(draws, minlength=30).double() / 40000
    assert torch.all(freq[probs == 0] == 0)
    assert (freq - probs).abs().max() < 4.5 * math.sqrt(0.25 / 40000)


def test_sampling_at_temperature_one_draws_the_same_tokens_without_a_division():
    """A decoding step's sampling at temperature 1 (an RL rollout's usual setting) makes no pass dividing the
    (rows, V) logits, and draws exactly the tokens the divided logits give."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    s = SamplingParams(temperature=1.0)
    with Ops() as ops:
        drawn = next_tokens(logits, s, torch.Generator().manual_seed(5))
    assert not [n for n in ops.names if n.startswith("div")], ops.names
    cdf = (logits / 1.0).softmax(-1).cumsum(-1)  # the draw spelled out: inverse CDF of the divided logits
    u = torch.rand(64, 1, generator=torch.Generator().manual_seed(5)) * cdf[:, -1:]
    assert torch.equal(drawn, torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=49))


def test_engine_falls_back_to_generate_for_a_sliding_window_model(tiny_tokenizer, tmp_path):
    config = Qwen2Config(vocab_size=len(tiny_tokenizer) + 8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0, pad_token_id=tiny_tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = PolicyModel(Qwen2ForCausalLM(config))
    batch = batch_of(tiny_tokenizer, TEXTS[:3])
    greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=6, ignore_eos=True)
    engine = DecodeEngine(model, tiny_tokenizer, device=CPU, dtype=torch.float32)
    out = engine.generate(batch, greedy)
    assert engine.shared_prefix_ok is False
    assert torch.equal(out["responses"], TransformersGenerate(model, tiny_tokenizer, device=CPU, dtype=torch.float32)
                       .generate(batch, greedy)["responses"])


def test_inference_weights_copy_in_the_compute_dtype_and_leave_the_model_alone(tiny_model_dir):
    model = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with inference_weights(model, torch.bfloat16) as copy:
        assert copy is not model and all(p.dtype == torch.bfloat16 for p in copy.parameters())
        assert not any(p.requires_grad for p in copy.parameters())
    with inference_weights(model, torch.float32) as same:
        assert same is model
    assert all(torch.equal(v, model.state_dict()[k]) and v.dtype == torch.float32 for k, v in before.items())


# ------------------------------------------------------------------ shared-prompt log-probs


def _shared_case(vocab: int):
    """4 prompts (two left-padded) x 3 responses (two shorter), rows of a prompt interleaved with others."""
    g = torch.Generator().manual_seed(0)
    P, L, U, n = 10, 6, 4, 3
    pm = torch.ones(U, P, dtype=torch.long)
    pm[1, :4], pm[3, :1] = 0, 0
    prompts = torch.randint(3, vocab, (U, P), generator=g) * pm
    rm = torch.ones(U * n, L, dtype=torch.long)
    rm[1, 3:], rm[7, 1:] = 0, 0
    responses = torch.randint(3, vocab, (U * n, L), generator=g) * rm
    order = torch.randperm(U * n, generator=g)  # rows of one prompt are not next to each other
    ids = torch.cat([prompts.repeat_interleave(n, 0), responses], 1)[order]
    mask = torch.cat([pm.repeat_interleave(n, 0), rm], 1)[order]
    uids = [str(int(i) // n) for i in order]
    return ids, mask, L, uids


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
    ids, mask, L, uids = _shared_case(lm.config.vocab_size)
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
    ids, mask, L, uids = _shared_case(model.config.vocab_size)
    plain, _ = model(ids, mask, L, with_entropy=False)
    assert model.shared_prompt_ok is None  # no prompt groups given: plain path, no check yet
    shared, _ = model(ids, mask, L, with_entropy=False, prompts=prompt_groups(uids))
    assert model.shared_prompt_ok is True
    assert torch.allclose(plain, shared, atol=1e-5)


def test_policy_model_keeps_the_plain_path_for_a_sliding_window_model(tiny_tokenizer):
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0)
    model = PolicyModel(Qwen2ForCausalLM(config))
    ids, mask, L, uids = _shared_case(64)
    out, _ = model(ids, mask, L, prompts=prompt_groups(uids))
    assert model.shared_prompt_ok is False and out.shape == (len(ids), L)
    assert model.config._attn_implementation != ATTENTION_NAME


def test_value_model_shares_prompts_with_the_same_values_and_gradients(tiny_model_dir):
    from posttrain.models.policy import ValueModel

    torch.manual_seed(0)
    model = ValueModel.from_pretrained(str(tiny_model_dir))
    ids, mask, L, uids = _shared_case(model.backbone.config.vocab_size)
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


# ------------------------------------------------------------------ bf16 on a CPU that emulates it

# (AVX512-BF16, AMX tiles) as torch reports them on three CPUs: AMD Zen 5, Intel Xeon with AMX, AMD Zen 3 (AVX2 only);
# plus AMX alone, which is enough for torch's bf16 matmul
CPU_KINDS = {"zen5": (True, False), "xeon_amx": (True, True), "amx_only": (False, True), "zen3_avx2": (False, False)}


def _simulate_cpu(monkeypatch, kind: str) -> None:
    from posttrain.models import cpu_bf16

    avx512_bf16, amx = CPU_KINDS[kind]
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    cpu_bf16.warn_emulated_bf16.cache_clear()


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_auto_dtype_is_bf16_only_on_a_cpu_with_bf16_instructions(kind, monkeypatch, caplog):
    from posttrain.models.load import compute_dtype

    _simulate_cpu(monkeypatch, kind)
    native = any(CPU_KINDS[kind])
    assert compute_dtype("auto", CPU) == (torch.bfloat16 if native else torch.float32)
    assert compute_dtype("fp32", CPU) == torch.float32
    assert not [r for r in caplog.records if "bf16" in r.getMessage()]  # `auto` never warns


def test_bf16_asked_for_on_a_cpu_that_emulates_it_warns_once_with_the_factor_and_what_to_use(monkeypatch, caplog):
    """A run with model.dtype=bf16 on an AVX2-only CPU is ~30x slower in its update: said once, at load."""
    from posttrain.models.load import compute_dtype

    _simulate_cpu(monkeypatch, "zen3_avx2")
    with caplog.at_level("WARNING"):
        assert compute_dtype("bf16", CPU) == torch.bfloat16  # what was asked for is kept
        assert compute_dtype("bfloat16", CPU) == torch.bfloat16
    said = [r.getMessage() for r in caplog.records if "bf16" in r.getMessage()]
    assert len(said) == 1, said
    assert "emulated" in said[0] and "GFLOP/s" in said[0] and "slower" in said[0] and "fp32" in said[0]


@pytest.mark.parametrize("kind", ["zen5", "xeon_amx"])
def test_bf16_on_a_cpu_with_bf16_instructions_says_nothing(kind, monkeypatch, caplog):
    from posttrain.models.cpu_bf16 import cpu_bf16_summary
    from posttrain.models.load import compute_dtype

    _simulate_cpu(monkeypatch, kind)
    with caplog.at_level("WARNING"):
        assert compute_dtype("bf16", CPU) == torch.bfloat16
    assert not caplog.records
    assert "native" in cpu_bf16_summary()
    _simulate_cpu(monkeypatch, "zen3_avx2")
    assert "emulated" in cpu_bf16_summary()  # what the benchmarks print beside their matmul ceilings


def test_grpo_step_benchmark_names_the_cpu_class_its_kernels_run_at_and_the_emulation():
    """benchmarks/grpo_step.py labels its numbers with the vector class in use: the widest the CPU has, capped by
    any emulation variable, with bf16 native only on AMX or AVX512-BF16 within that class."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import grpo_step as bench

    cpuinfo = ("processor\t: 0\nmodel name\t: Some CPU 9000\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16\n"
               "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    model, flags = bench.cpu_flags(cpuinfo)
    assert model == "Some CPU 9000" and {"avx2", "avx512f", "avx512_bf16"} <= flags and "fpu" in flags
    zen3 = {"avx", "avx2", "fma"}
    xeon = zen3 | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert bench.cpu_class(zen3, {}) == ("AVX2", False)
    assert bench.cpu_class({"avx", "avx2", "avx512f"}, {}) == ("AVX-512", False)
    assert bench.cpu_class(flags, {}) == ("AVX-512", True)
    assert bench.cpu_class(xeon, {}) == ("AMX", True)
    emulated = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert bench.cpu_class(xeon, emulated) == ("AVX2", False)
    assert bench.cpu_class(xeon, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) == ("AVX-512", True)
    assert bench.cpu_class(zen3, {"ATEN_CPU_CAPABILITY": "avx512"}) == ("AVX2", False)  # a cap never widens


# ------------------------------------------------------------------ packed (padding-free) micro-batches

def _packed_case(vocab: int):
    """5 rows of a long-tail length mix: prompts left-padded, responses right-padded, and a multi-turn
    `response_mask` with holes (tool tokens the forward attends to but the loss skips)."""
    g = torch.Generator().manual_seed(1)
    P, L = 9, 12
    prompt_lens, response_lens = [9, 3, 6, 1, 5], [12, 2, 7, 12, 1]
    ids = torch.randint(3, vocab, (5, P + L), generator=g)
    mask = torch.zeros(5, P + L, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[row, P - p:P + r] = 1
    ids = ids * mask
    response_mask = mask[:, P:].clone()
    response_mask[0, 3:6] = 0  # tool results inside the response
    response_mask[3, 1:4] = 0
    return ids, mask, L, response_mask


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype,checkpointing", [(torch.float32, False), (torch.float32, True),
                                                 (torch.float64, False)])
def test_packed_logprobs_entropies_and_gradients_equal_the_padded_forward(tiny_model_dir, dtype, checkpointing):
    """Log-probs, entropies and every parameter's gradient of the padding-free forward are the padded forward's."""
    lm = load_causal_lm(str(tiny_model_dir)).to(dtype)
    if checkpointing:
        enable_checkpointing(lm)
    lm.train()
    ids, mask, L, response_mask = _packed_case(lm.config.vocab_size)
    weights = response_mask.to(dtype) * torch.linspace(-1, 1, L, dtype=dtype)
    results = []
    for packed in (False, True):
        lm.zero_grad()
        lm.config._attn_implementation = ATTENTION_NAME if packed else "sdpa"
        logp, ent = response_logprobs(lm, ids, mask, L, packed=packed)
        ((logp * weights).sum() + 0.3 * (ent * weights).sum()).backward()
        results.append((logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in lm.named_parameters()}))
    (lp0, e0, g0), (lp1, e1, g1) = results
    real = mask[:, -L:].bool()
    torch.testing.assert_close(lp1[real], lp0[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1[real], e0[real], rtol=1e-5, atol=1e-6)
    assert not lp1[~real].any() and not e1[~real].any()  # response padding: 0, as the padded path gives
    for k in g0:
        assert _relative(g1[k], g0[k]) < 1e-5, k


def test_packed_attention_keeps_each_row_to_itself(tiny_model_dir):
    """A row's log-probs do not depend on the rows packed beside it (no attention across rows)."""
    lm = load_causal_lm(str(tiny_model_dir))
    lm.config._attn_implementation = ATTENTION_NAME
    ids, mask, L, _ = _packed_case(lm.config.vocab_size)
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
    ids, mask, L, response_mask = _packed_case(reference.config.vocab_size)
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
    real = mask[:, -L:].bool()
    for part in (0, 1):
        want = results["float64"][part]
        pick = (lambda x: x[real]) if part == 0 else (lambda x: x)
        padded_error = _relative(pick(results["padded"][part]), pick(want))
        packed_error = _relative(pick(results["packed"][part]), pick(want))
        assert packed_error <= 2 * padded_error + 1e-3, (part, packed_error, padded_error)


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
    ids, mask, L, uids = _shared_case(model.config.vocab_size)
    with torch.no_grad():
        plain, _ = model(ids, mask, L, with_entropy=False)
        packed, _ = model(ids, mask, L, with_entropy=False, prompts=prompt_groups(uids), packed=True)
    assert model.packed_ok is True and model.shared_prompt_ok is True
    real = mask[:, -L:].bool()
    torch.testing.assert_close(packed[real], plain[real], rtol=1e-5, atol=1e-6)


def test_policy_model_keeps_padded_rows_for_a_sliding_window_model(tiny_tokenizer):
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4,
                         max_window_layers=0)
    model = PolicyModel(Qwen2ForCausalLM(config))
    ids, mask, L, _ = _packed_case(64)
    out, _ = model(ids, mask, L, packed=True)
    assert model.packed_ok is False and out.shape == (len(ids), L)
    assert model.config._attn_implementation != ATTENTION_NAME


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_values_and_gradients_equal_the_padded_forward(tiny_model_dir, dtype):
    from posttrain.models.policy import ValueModel

    torch.manual_seed(0)
    model = ValueModel.from_pretrained(str(tiny_model_dir)).to(dtype)
    model.train()
    ids, mask, L, response_mask = _packed_case(model.backbone.config.vocab_size)
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
        assert _relative(g1[k], g0[k]) < 1e-5, k
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
    ids, mask, L, uids = _shared_case(lm.config.vocab_size)
    weights = mask[:, -L:].to(dtype) * torch.linspace(-1, 1, L, dtype=dtype)
    results = []
    for packed in (False, True):
        lm.zero_grad()
        lm.config._attn_implementation = ATTENTION_NAME if packed else "sdpa"
        logp, ent = response_logprobs(lm, ids, mask, L, packed=packed, prompts=prompt_groups(uids) if packed else None)
        ((logp * weights).sum() + 0.3 * (ent * weights).sum()).backward()
        results.append((logp.detach(), ent.detach(), {k: p.grad.clone() for k, p in lm.named_parameters()}))
    (lp0, e0, g0), (lp1, e1, g1) = results
    real = mask[:, -L:].bool()
    torch.testing.assert_close(lp1[real], lp0[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1[real], e0[real], rtol=1e-5, atol=1e-6)
    for k in g0:
        assert _relative(g1[k], g0[k]) < 1e-5, k


def test_value_model_packs_shared_prompts_with_the_padded_values_and_gradients(tiny_model_dir):
    from posttrain.models.policy import ValueModel

    torch.manual_seed(0)
    model = ValueModel.from_pretrained(str(tiny_model_dir)).double()
    ids, mask, L, uids = _shared_case(model.backbone.config.vocab_size)
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
        assert _relative(g1[k], g0[k]) < 1e-5, k
