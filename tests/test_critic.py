"""The critic: its value loss falls on a fixed batch, GAE on real rollouts equals the spec, save/load round trip."""

import math

import torch

from posttrain.algo import compute_advantage
from posttrain.config import load_config
from posttrain.models.load import load_causal_lm
from posttrain.models.policy import ValueModel
from posttrain.parallel import Parallel
from posttrain.roles.common import ModelRunner
from posttrain.roles.critic import Critic
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.transformers_generate import TransformersGenerate
from tests.test_roles_rollout import prompts_batch

CPU = torch.device("cpu")


def real_batch(tiny_model_dir, tok):
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    engine = TransformersGenerate(model, tok, device=CPU, dtype=torch.float32)
    return engine.generate(prompts_batch(tok, ["1+2=", "33+44=", "5+5=", "9+9="]), SamplingParams(n=2, max_new_tokens=6))


def make_critic(tiny_model_dir, lr=1e-3):
    cfg = load_config(None, [f"critic.optim.lr={lr}", "critic.cliprange_value=100"])
    runner = ModelRunner(ValueModel.from_pretrained(str(tiny_model_dir)), Parallel(), dtype=torch.float32)
    return Critic(runner, cfg.critic, cfg.actor_rollout_ref.actor, max_response_length=6, total_steps=10)


def test_value_loss_falls_on_a_fixed_batch(tiny_model_dir, tiny_tokenizer):
    batch = real_batch(tiny_model_dir, tiny_tokenizer)
    critic = make_critic(tiny_model_dir)
    batch["returns"] = torch.linspace(-1, 1, batch["responses"].numel()).view_as(batch["responses"].float())
    batch["returns"] = batch["returns"] * batch["response_mask"]
    losses = []
    for _ in range(15):
        batch["values"] = critic.compute_values(batch)
        losses.append(critic.update(batch)["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0], losses


def gae_reference(rewards, values, mask, gamma, lam):
    """ALGORITHMS.md GAE, float64, one response at a time."""
    B, L = len(rewards), len(rewards[0])
    adv = [[0.0] * L for _ in range(B)]
    for i in range(B):
        next_value, last = 0.0, 0.0
        for t in reversed(range(L)):
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            cand = delta + gamma * lam * last
            next_value = mask[i][t] * values[i][t] + (1 - mask[i][t]) * next_value
            last = mask[i][t] * cand + (1 - mask[i][t]) * last
            adv[i][t] = last
    flat = [adv[i][t] for i in range(B) for t in range(L) if mask[i][t]]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    whitened = [[(adv[i][t] - mean) / math.sqrt(var + 1e-8) for t in range(L)] for i in range(B)]
    returns = [[adv[i][t] + values[i][t] for t in range(L)] for i in range(B)]
    return whitened, returns


def test_gae_on_real_rollouts_matches_the_spec(tiny_model_dir, tiny_tokenizer):
    batch = real_batch(tiny_model_dir, tiny_tokenizer)
    values = make_critic(tiny_model_dir).compute_values(batch).double()
    mask = batch["response_mask"].double()
    scores = torch.zeros_like(mask)
    last = mask.sum(-1).long() - 1
    scores[torch.arange(len(mask)), last] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95)):
        adv, ret = compute_advantage("gae", token_level_rewards=scores, response_mask=mask, values=values,
                                     gamma=gamma, lam=lam)
        want_adv, want_ret = gae_reference(scores.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        sel = mask.bool()
        assert torch.allclose(adv[sel], torch.tensor(want_adv, dtype=torch.float64)[sel], atol=1e-9)
        assert torch.allclose(ret[sel], torch.tensor(want_ret, dtype=torch.float64)[sel], atol=1e-9)


def test_value_model_save_and_load(tmp_path, tiny_model_dir, tiny_tokenizer):
    batch = real_batch(tiny_model_dir, tiny_tokenizer)
    critic = make_critic(tiny_model_dir)
    before = critic.compute_values(batch)
    critic.model.save_pretrained(tmp_path / "critic")
    fresh = make_critic(tmp_path / "critic")  # an exported critic restores its value head too
    assert torch.allclose(fresh.compute_values(batch), before, atol=1e-6)
