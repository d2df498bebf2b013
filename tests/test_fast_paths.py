"""The decoding fast paths give the plain paths' results: posttrain's decoding engine (shared prompts, finished rows
dropped, its own sampler), and the compute dtype chosen for the CPU it runs on.

References are independent of the code under test: transformers' own `generate`, transformers' own logits
warpers, and the exact probabilities of the model's plain forward."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.data.batch import Batch
from posttrain.models.load import load_causal_lm
from posttrain.models.policy import PolicyModel
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
