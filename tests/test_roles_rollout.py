"""Rollout and actor wiring on the tiny model: response masks, micro-batch invariance of the update, SFT CLI."""

import contextlib
import json
import subprocess
import sys

import pytest
import torch

from posttrain.config import load_config
from posttrain.data.batch import Batch
from posttrain.data.dataset import PromptItem, collate_prompts
from posttrain.models.load import load_causal_lm
from posttrain.models.policy import PolicyModel
from posttrain.parallel import Parallel
from posttrain.roles.actor import Actor
from posttrain.roles.common import ModelRunner
from posttrain.rollout.base import SamplingParams, response_mask_from
from posttrain.rollout.transformers_generate import TransformersGenerate

CPU = torch.device("cpu")


def test_response_mask_stops_after_first_eos():
    r = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert response_mask_from(r, {2}, 0, False).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert response_mask_from(r, {2}, 0, True).tolist() == [[1] * 4] * 3


def test_rollout_engines_are_chosen_by_name(tiny_model_dir, tiny_tokenizer):
    """`rollout.name`: `hf` is transformers' generate; `posttrain`, `sglang` and `trtllm` run posttrain's engine
    (`enforce_eager` turning its CUDA graphs off); `vllm` is vLLM's engine, built from a run's config
    (tests/test_vllm_engine.py); an unknown name is refused by name."""
    from posttrain.rollout.engine import DecodeEngine
    from posttrain.rollout.registry import build_engine, register

    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    settings = dict(device=CPU, dtype=torch.float32, micro_batch_size=2)
    assert type(build_engine("hf", model, tiny_tokenizer, **settings)) is TransformersGenerate
    for name in ("posttrain", "sglang", "trtllm"):
        engine = build_engine(name, model, tiny_tokenizer, enforce_eager=True, **settings)
        assert type(engine) is DecodeEngine and engine.micro_batch_size == 2 and not engine.cuda_graphs
    with pytest.raises(ValueError, match="built from a run's config"):
        build_engine("vllm", model, tiny_tokenizer, **settings)
    with pytest.raises(ValueError, match="rollout.name='vlm'.*known: hf, posttrain"):
        build_engine("vlm", model, tiny_tokenizer, **settings)
    with pytest.raises(ValueError, match="already registered"):
        register("hf")(lambda *a, **k: None)


def prompts_batch(tok, texts):
    items = [PromptItem(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                tokenize=True)["input_ids"], "synthetic/arithmetic", "0") for t in texts]
    ids, mask = collate_prompts(items, tok.pad_token_id)
    return Batch({"prompts": ids, "prompt_mask": mask}, {"uid": [str(i) for i in range(len(texts))]})


def test_rollout_shapes_groups_and_greedy_determinism(tiny_model_dir, tiny_tokenizer):
    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    engine = TransformersGenerate(model, tiny_tokenizer, device=CPU, dtype=torch.float32, micro_batch_size=1)
    batch = prompts_batch(tiny_tokenizer, ["1+2=", "33+44="])
    torch.manual_seed(0)
    out = engine.generate(batch, SamplingParams(n=3, max_new_tokens=6, temperature=1.0))
    assert out["responses"].shape[0] == 6 and out["responses"].shape[1] <= 6
    assert out.meta["uid"] == ["0", "0", "0", "1", "1", "1"]
    assert torch.equal(out["input_ids"][:, : out["prompts"].shape[1]], out["prompts"])
    # padding after the mask is the pad id, and the mask is a prefix of ones
    m = out["response_mask"]
    assert torch.all(m[:, 1:] <= m[:, :-1]) and torch.all(out["responses"][m == 0] == tiny_tokenizer.pad_token_id)
    g1 = engine.generate(batch, SamplingParams(n=1, do_sample=False, max_new_tokens=6))
    g2 = engine.generate(batch, SamplingParams(n=1, do_sample=False, max_new_tokens=6))
    assert torch.equal(g1["responses"], g2["responses"])


def test_decode_returns_the_version_of_each_forward_and_none_without_a_hook(tiny_model_dir, tiny_tokenizer):
    """`decode`, what `generate` and the multi-turn loop run each chunk through: without a `between_steps` hook it
    returns no versions; with one, the hook names the version before the prefill and before each decoding step of
    posttrain's engine (k tokens: k versions, the hook called k times, never by the engine's self-check), and once
    per chunk for transformers' generate, which cannot swap weights mid-chunk; the tokens are those decoded without
    the hook."""
    from posttrain.rollout.engine import DecodeEngine
    from posttrain.rollout.weights import inference_weights

    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    batch = prompts_batch(tiny_tokenizer, ["1+2=", "33+44="])
    s = SamplingParams(n=1, do_sample=False, max_new_tokens=5, ignore_eos=True)
    for kind, forwards in ((DecodeEngine, s.max_new_tokens), (TransformersGenerate, 1)):
        engine = kind(model, tiny_tokenizer, device=CPU, dtype=torch.float32)
        calls = []
        with inference_weights(engine.model, engine.dtype) as weights:
            plain, _, none = engine.decode(weights, batch["prompts"], batch["prompt_mask"], s)
            engine.between_steps = lambda decoding: calls.append(decoding) or 10 * len(calls)
            fresh = kind(model, tiny_tokenizer, device=CPU, dtype=torch.float32)  # its self-check still to run
            fresh.between_steps = engine.between_steps
            for e in (engine, fresh):
                calls.clear()
                tokens, _, versions = e.decode(weights, batch["prompts"], batch["prompt_mask"], s)
                assert none is None and torch.equal(tokens, plain), kind
                assert versions == [10 * (i + 1) for i in range(forwards)] and len(calls) == forwards, kind
                assert all(c is weights for c in calls) and e.step_versions is None


def update_batch(model, tokenizer) -> Batch:
    """Six sampled responses (3 prompts x 2) with random advantages, old and reference log-probs: an actor update's
    input."""
    engine = TransformersGenerate(model, tokenizer, device=CPU, dtype=torch.float32)
    batch = engine.generate(prompts_batch(tokenizer, ["1+2=", "33+44=", "5+5="]), SamplingParams(n=2, max_new_tokens=5))
    B, L = batch["responses"].shape
    batch["advantages"] = torch.randn(B, L) * batch["response_mask"]
    batch["old_log_probs"] = torch.randn(B, L) * 0.1 - 2
    batch["ref_log_probs"] = torch.randn(B, L) * 0.1 - 2
    return batch


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_actor_gradient_does_not_depend_on_micro_batches(tiny_model_dir, tiny_tokenizer, mode):
    """Same mini-batch, one pass vs micro-batches of 1 and 3: the same accumulated gradient (KL and entropy on)."""
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    batch = update_batch(model, tiny_tokenizer)
    grads = []
    for micro in (None, 1, 3):
        cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.use_kl_loss=True",
                                 "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.grad_clip=1e9",
                                 f"actor_rollout_ref.actor.loss_agg_mode={mode}",
                                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro or 'null'}"])
        actor = Actor(ModelRunner(PolicyModel(model), Parallel(), dtype=torch.float32), cfg.actor_rollout_ref.actor,
                      temperature=1.0, max_response_length=5, total_steps=1)
        seen = []  # the accumulated gradient, read just before the optimizer step (which frees it after)
        actor.optimizer.register_step_pre_hook(
            lambda *_: seen.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
        metrics = actor.update(batch)
        grads.append(seen[0])
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    assert torch.allclose(grads[0], grads[2], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_bf16_micro_batches_cast_each_weight_once_and_keep_the_gradient_bit_for_bit(tiny_model_dir, tiny_tokenizer,
                                                                                   monkeypatch, checkpointing):
    """Under bf16 autocast a mini-batch's micro-batches reuse the first one's weight casts (`casts_kept`): the
    accumulated gradient is bit for bit the one of casting again in every micro-batch (with activation checkpointing
    too, whose backward recomputes each layer), and the float32 -> bf16 copies of the trainable weights are made once
    per mini-batch instead of once per micro-batch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from posttrain.models.load import enable_checkpointing

    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    if checkpointing:
        enable_checkpointing(model)
    batch = update_batch(model, tiny_tokenizer)
    B = batch["responses"].shape[0]
    weights = {p.data_ptr(): p.shape for p in model.parameters()}

    class WeightCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16
                    and args[0].dtype == torch.float32 and weights.get(args[0].data_ptr()) == args[0].shape):
                WeightCasts.count += 1
            return func(*args, **kwargs)

    grads, casts = [], []
    for kept in (True, False):
        if not kept:
            monkeypatch.setattr(ModelRunner, "casts_kept", lambda self: contextlib.nullcontext())
        cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.grad_clip=1e9",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"])
        actor = Actor(ModelRunner(PolicyModel(model), Parallel(), dtype=torch.bfloat16), cfg.actor_rollout_ref.actor,
                      temperature=1.0, max_response_length=5, total_steps=1)
        actor.runner.packs()  # the one-time packed check runs before counting
        seen = []
        actor.optimizer.register_step_pre_hook(
            lambda *_: seen.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
        WeightCasts.count = 0
        with WeightCasts():
            actor.update(batch)
        grads.append(seen[0])
        casts.append(WeightCasts.count)
    assert torch.equal(grads[0], grads[1])
    matrices = sum(p.dim() == 2 for p in model.parameters())
    assert matrices <= casts[0] < casts[1] and casts[1] >= B * matrices // 2, casts


def test_sft_cli_trains_on_response_tokens(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "response": f"#### {2 * a}"} for a in range(12)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "sft", "--model", str(tiny_model_dir),
                          "--train-files", str(tmp_path / "sft.jsonl"), "--val-files", str(tmp_path / "sft.jsonl"),
                          "--output-dir", str(tmp_path / "out"), "--epochs", "10", "--lr", "3e-3", "--batch-size", "4",
                          "--eval-every", "10"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    history = json.loads((tmp_path / "out" / "sft_history.json").read_text())["history"]
    assert history[-1]["dev_loss"] < history[0]["dev_loss"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_sft_stops_where_stop_when_says_and_saves_that_model(tmp_path, tiny_model_dir):
    """`stop_when` is asked at each evaluation, with the model in eval mode and no gradient; its first True ends the
    training there, and the model it judged is the one saved."""
    from safetensors.torch import load_file

    from posttrain.trainer.sft import SFTArgs, run_sft

    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "response": f"#### {2 * a}"} for a in range(12)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    asked = []

    def stop_when(model):
        asked.append((model.training, torch.is_grad_enabled(), {k: v.clone() for k, v in model.state_dict().items()}))
        return len(asked) == 3

    result = run_sft(SFTArgs(model_path=str(tiny_model_dir), train_files=[str(tmp_path / "sft.jsonl")],
                             output_dir=str(tmp_path / "out"), epochs=10, lr=3e-3, batch_size=4, eval_every=5,
                             quiet=True, stop_when=stop_when))  # 30 steps without it
    assert result["steps"] == 15 and [(training, grad) for training, grad, _ in asked] == [(False, False)] * 3
    history = json.loads((tmp_path / "out" / "sft_history.json").read_text())["history"]
    assert [r["step"] for r in history] == [5, 10, 15]
    saved = load_file(tmp_path / "out" / "model.safetensors")
    judged = asked[-1][2]
    assert saved.keys() <= judged.keys() and all(torch.equal(saved[k], judged[k]) for k in saved)
    assert not torch.equal(asked[0][2]["lm_head.weight"], judged["lm_head.weight"])  # it did train in between


def test_concat_rollouts_repads_prompts_left_and_responses_right():
    from posttrain.rollout.base import concat_rollouts

    def rollout(prompts, responses, scores):
        p, r = torch.tensor(prompts), torch.tensor(responses)
        pm, rm = (p != 0).long(), (r != 0).long()
        return Batch({"prompts": p, "prompt_mask": pm, "responses": r, "response_mask": rm,
                      "input_ids": torch.cat([p, r], 1), "attention_mask": torch.cat([pm, rm], 1),
                      "token_level_scores": torch.tensor(scores), "reward_baselines": torch.tensor([0.5])},
                     {"uid": ["a"]})

    a = rollout([[0, 7, 8]], [[3, 0]], [[1.0, 0.0]])
    b = rollout([[9, 9]], [[4, 5, 6]], [[0.0, 0.0, 2.0]])
    out = concat_rollouts([a, b], pad_id=0)
    assert out["prompts"].tolist() == [[0, 7, 8], [0, 9, 9]]
    assert out["responses"].tolist() == [[3, 0, 0], [4, 5, 6]]
    assert out["token_level_scores"].tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]]
    assert out["input_ids"].tolist() == [[0, 7, 8, 3, 0, 0], [0, 9, 9, 4, 5, 6]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]]
    assert out["reward_baselines"].tolist() == [0.5, 0.5] and out.meta["uid"] == ["a", "a"]


def test_concat_over_rounds_keeps_every_reward_key():
    """A reward key that only a later DAPO round (or another rank) returned is kept, None on the rows without it;
    a key only the first round returned is kept too."""
    def scored(uids, **extras):
        n = len(uids)
        return Batch({"prompts": torch.ones(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
                      "responses": torch.ones(n, 3, dtype=torch.long), "response_mask": torch.ones(n, 3, dtype=torch.long)},
                     {"uid": uids, **{f"reward:{k}": v for k, v in extras.items()}})

    from posttrain.rollout.base import concat_rollouts

    rounds = [scored(["a", "a"], acc=[1.0, 0.0], fmt=[1.0, 1.0]), scored(["b", "b"], acc=[0.0, 1.0]),
              scored(["c"], acc=[1.0], pass_rate=[0.5])]
    for out in (concat_rollouts(rounds, pad_id=0), Batch.concat(rounds)):
        assert out.meta["uid"] == ["a", "a", "b", "b", "c"]
        assert out.meta["reward:acc"] == [1.0, 0.0, 0.0, 1.0, 1.0]
        assert out.meta["reward:fmt"] == [1.0, 1.0, None, None, None]
        assert out.meta["reward:pass_rate"] == [None, None, None, None, 0.5]


# ------------------------------------------------------------------ multi-turn batches (response_mask with holes)

EPISODES = [  # (response_mask, response_attention_mask) of each row; 0 in the first where a tool result etc. is
    ([1, 1, 1, 0, 0, 0, 1, 1, 1], [1] * 9),
    ([1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0], [1] * 11),  # appended tokens after its last policy token
    ([1, 0, 0, 1, 1, 1, 1], [1] * 7),
    ([1, 1, 0, 0, 1, 0, 0, 0, 0, 0], [1] * 10),
]


def multi_turn_batch(vocab: int, *, width: int = 13) -> Batch:
    """Two prompts (one left-padded) x two episodes each, in the multi-turn layout: `response_mask` 1 on the
    policy's tokens only, `response_attention_mask` on every real response token, attention_mask their prompt's
    mask then the latter. Each row's policy tokens reach past the most policy tokens any row has (6), so a width
    taken from response_mask would cut them off."""
    g = torch.Generator().manual_seed(1)
    prompt_mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    prompts = (torch.randint(3, vocab, prompt_mask.shape, generator=g) * prompt_mask).repeat_interleave(2, 0)
    prompt_mask = prompt_mask.repeat_interleave(2, 0)
    policy = torch.zeros(4, width, dtype=torch.long)
    real = torch.zeros(4, width, dtype=torch.long)
    for i, (m, a) in enumerate(EPISODES):
        policy[i, : len(m)], real[i, : len(a)] = torch.tensor(m), torch.tensor(a)
    responses = torch.randint(3, vocab, real.shape, generator=g) * real
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": policy,
                  "response_attention_mask": real, "input_ids": torch.cat([prompts, responses], 1),
                  "attention_mask": torch.cat([prompt_mask, real], 1)}, {"uid": ["a", "a", "b", "b"]})


def plain_forward(lm, batch: Batch, temperature: float):
    """Float64 log-probs and entropies of every response token from one ordinary forward over the whole sequences
    (positions counted over the real tokens)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    L = batch["responses"].shape[1]
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    z = logits[:, -(L + 1):-1].double() / temperature
    logp = torch.log_softmax(z, -1)
    chosen = logp.gather(-1, ids[:, -L:, None]).squeeze(-1)
    entropy = torch.logsumexp(z, -1) - (logp.exp() * z).sum(-1)
    return chosen, entropy


@pytest.mark.parametrize("micro,max_tokens", [(None, None), (3, None), (None, 40)])
def test_old_and_reference_log_probs_of_an_episode_batch_equal_a_plain_forward(tiny_model_dir, micro, max_tokens):
    """The old-log-prob pass (prompts shared and not) and the reference pass on a batch with holes give, at every
    policy token, the log-prob and entropy of one plain forward over prompt, policy and appended tokens."""
    from posttrain.roles.reference import Reference

    cfg = load_config(None, [])
    model = PolicyModel(load_causal_lm(str(tiny_model_dir), device=CPU))
    batch = multi_turn_batch(model.config.vocab_size)
    policy = batch["response_mask"].bool()
    want_logp, want_ent = plain_forward(model.lm, batch, 0.7)
    actor = Actor(ModelRunner(model, Parallel(), dtype=torch.float32), cfg.actor_rollout_ref.actor, temperature=0.7,
                  max_response_length=13, total_steps=1)
    without_uid = Batch(batch.tensors, {})  # no prompt groups: the plain path
    for rows in (batch, without_uid):
        logp, ent = actor.compute_log_prob(rows, micro_batch_size=micro, max_tokens=max_tokens, with_entropy=True)
        assert logp.shape == ent.shape == policy.shape
        torch.testing.assert_close(logp[policy].double(), want_logp[policy], atol=2e-5, rtol=0)
        torch.testing.assert_close(ent[policy].double(), want_ent[policy], atol=2e-5, rtol=0)
    assert model.shared_prompt_ok is True  # the shared-prompt path did run
    reference = Reference(ModelRunner(model, Parallel(), dtype=torch.float32), cfg.actor_rollout_ref.ref,
                          temperature=0.7)
    torch.testing.assert_close(reference.compute_log_prob(batch)[policy].double(), want_logp[policy], atol=2e-5,
                               rtol=0)


def test_critic_values_of_an_episode_batch_equal_a_plain_forward(tiny_model_dir):
    """The critic's value for each policy token is the value head on the plain forward's hidden state before it."""
    from posttrain.models.policy import ValueModel
    from posttrain.roles.critic import Critic

    cfg = load_config(None, [])
    torch.manual_seed(0)
    model = ValueModel.from_pretrained(str(tiny_model_dir))
    batch = multi_turn_batch(model.backbone.config.vocab_size)
    ids, mask, L = batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]
    with torch.no_grad():
        hidden = model.backbone(input_ids=ids, attention_mask=mask,
                                position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
        want = model.value_head(hidden).squeeze(-1)[:, -(L + 1):-1]
    critic = Critic(ModelRunner(model, Parallel(), dtype=torch.float32), cfg.critic, cfg.actor_rollout_ref.actor,
                    max_response_length=13, total_steps=1)
    policy = batch["response_mask"].bool()
    for rows in (batch, Batch(batch.tensors, {})):
        values = critic.compute_values(rows)
        torch.testing.assert_close(values[policy], want[policy], atol=2e-5, rtol=0)
        assert not values[~policy].any()  # nothing off the policy's tokens (GAE skips them)


def test_forward_width_keeps_every_real_response_token():
    """A forward's response width reaches each row's last real token, appended tokens after its last policy token
    included; a single-turn batch keeps its width as before."""
    from posttrain.roles.common import padded_widths, trimmed

    batch = multi_turn_batch(50)
    ids, mask, width, full = trimmed(batch)
    assert (width, full) == (11, 13) and ids.shape[1] == 6 + 11
    assert padded_widths(batch) == ([6, 6, 4, 4], [9, 11, 7, 10])
    single = Batch({k: batch[k] for k in ("prompts", "prompt_mask", "responses", "input_ids")}
                   | {"response_mask": batch["response_attention_mask"],
                      "attention_mask": batch["attention_mask"]})
    assert trimmed(single)[2] == 11 and padded_widths(single)[1] == [9, 11, 7, 10]


def test_concat_rollouts_keeps_the_holes_and_attends_to_every_real_token():
    from posttrain.rollout.base import concat_rollouts

    batch = multi_turn_batch(50)
    narrow = batch.select([2, 3])
    for key in ("responses", "response_mask", "response_attention_mask"):
        narrow[key] = narrow[key][:, :10]
    narrow["prompts"], narrow["prompt_mask"] = narrow["prompts"][:, 2:], narrow["prompt_mask"][:, 2:]
    out = concat_rollouts([batch.select([0, 1]), narrow], pad_id=0)
    assert out["response_mask"].tolist() == batch["response_mask"].tolist()
    assert out["response_attention_mask"].tolist() == batch["response_attention_mask"].tolist()
    assert out["attention_mask"].tolist() == batch["attention_mask"].tolist()
    assert out["input_ids"].tolist() == batch["input_ids"].tolist()


# ------------------------------------------------------------------ packed (padding-free) micro-batches

def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _update_gradient(role, model, batch) -> torch.Tensor:
    """The accumulated gradient of one update, read just before the optimizer step (which frees it after)."""
    seen = []
    role.optimizer.register_step_pre_hook(
        lambda *_: seen.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])))
    role.update(batch)
    return seen[0]


def _trained_batch(vocab: int) -> Batch:
    batch = multi_turn_batch(vocab)
    g = torch.Generator().manual_seed(2)
    B, L = batch["responses"].shape
    policy = batch["response_mask"]
    batch["advantages"] = torch.randn(B, L, generator=g) * policy
    batch["old_log_probs"] = (torch.randn(B, L, generator=g) * 0.1 - 2) * policy
    batch["ref_log_probs"] = (torch.randn(B, L, generator=g) * 0.1 - 2) * policy
    batch["values"] = torch.randn(B, L, generator=g) * policy
    batch["returns"] = torch.randn(B, L, generator=g) * policy
    return batch


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_old_and_reference_log_probs_equal_the_padded_passes(tiny_model_dir, dtype):
    """`use_remove_padding`: the old-log-prob pass (log-probs, entropies) and the reference pass on a batch with
    holes give the padded passes' values, whole or in token-budget micro-batches (1e-5 relative)."""
    from posttrain.roles.reference import Reference

    cfg = load_config(None, [])
    results = {}
    for packed in (False, True):
        model = PolicyModel(load_causal_lm(str(tiny_model_dir), device=CPU).to(dtype))
        batch = multi_turn_batch(model.config.vocab_size)
        runner = ModelRunner(model, Parallel(), dtype=dtype, remove_padding=packed)
        actor = Actor(runner, cfg.actor_rollout_ref.actor, temperature=0.7, max_response_length=13, total_steps=1)
        reference = Reference(runner, cfg.actor_rollout_ref.ref, temperature=0.7)
        results[packed] = [*actor.compute_log_prob(batch, with_entropy=True),
                           *actor.compute_log_prob(batch, max_tokens=20, with_entropy=True),
                           reference.compute_log_prob(batch)]
        assert model.packed_ok is (True if packed else None)
    real = batch["response_attention_mask"].bool()
    for padded, packed in zip(results[False], results[True]):
        torch.testing.assert_close(packed[real], padded[real], rtol=1e-5, atol=1e-6)


def test_packed_actor_update_gradient_equals_the_padded_one_at_any_micro_batch_split(tiny_model_dir):
    """The actor's accumulated gradient (KL and entropy on) with packed micro-batches is the padded forward's,
    whether the mini-batch runs whole or split by a real-token budget (float32: the update's norm clipping takes
    float32; float64 gradients: tests/test_packed.py)."""
    dtype = torch.float32
    grads = {}
    for packed, max_tokens in ((False, None), (True, None), (True, 20)):
        model = PolicyModel(load_causal_lm(str(tiny_model_dir), device=CPU).to(dtype))
        extra = ["actor_rollout_ref.actor.use_dynamic_bsz=True",
                 f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={max_tokens}"] if max_tokens else []
        cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.use_kl_loss=True",
                                 "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.grad_clip=1e9",
                                 *extra])
        runner = ModelRunner(model, Parallel(), dtype=dtype, remove_padding=packed)
        actor = Actor(runner, cfg.actor_rollout_ref.actor, temperature=0.7, max_response_length=13, total_steps=1)
        batch = _trained_batch(model.config.vocab_size)
        if max_tokens:
            assert len(runner.micro_parts(batch, None, max_tokens=max_tokens)) > 1
        grads[packed, max_tokens] = _update_gradient(actor, model, batch)
    assert _relative(grads[True, None], grads[False, None]) < 1e-5
    assert _relative(grads[True, 20], grads[False, None]) < 1e-5


def test_packed_critic_values_and_update_gradient_equal_the_padded_ones(tiny_model_dir):
    from posttrain.models.policy import ValueModel
    from posttrain.roles.critic import Critic

    cfg = load_config(None, ["critic.optim.lr=0", "critic.grad_clip=1e9"])
    results = {}
    for packed in (False, True):
        torch.manual_seed(0)
        model = ValueModel.from_pretrained(str(tiny_model_dir))
        batch = _trained_batch(model.backbone.config.vocab_size)
        critic = Critic(ModelRunner(model, Parallel(), dtype=torch.float32, remove_padding=packed), cfg.critic,
                        cfg.actor_rollout_ref.actor, max_response_length=13, total_steps=1)
        results[packed] = (critic.compute_values(batch), _update_gradient(critic, model, batch))
        assert model.packed_ok is (True if packed else None)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-6)
    assert _relative(results[True][1], results[False][1]) < 1e-5
