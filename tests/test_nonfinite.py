"""Non-finite losses and gradients: the update is skipped (weights untouched) and counted, a finite update resets
the count, and `limit` skipped updates in a row stop the run naming the quantity that went non-finite first."""

import json
import math

import pytest
import torch

from posttrain.config import load_config
from posttrain.models.load import load_causal_lm
from posttrain.models.policy import PolicyModel, ValueModel
from posttrain.parallel import Parallel
from posttrain.roles.actor import Actor
from posttrain.roles.common import ModelRunner
from posttrain.roles.critic import Critic
from posttrain.roles.nonfinite import NonFiniteError, NonFiniteGuard, first_nonfinite
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.transformers_generate import TransformersGenerate
from tests.test_roles_rollout import prompts_batch

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_first_nonfinite_follows_the_order_given_and_reads_masked_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    padded_nan = torch.tensor([[0.0, 1.0, math.nan], [2.0, math.inf, 0.0]])  # NaN/inf only in padding
    assert first_nonfinite([("advantages", padded_nan)], mask) is None
    bad = torch.tensor([[math.nan, math.inf, 0.0], [math.nan, 0.0, 0.0]])
    assert first_nonfinite([("advantages", padded_nan), ("log_probs", bad), ("pg_loss", torch.tensor(math.nan))],
                           mask) == "log_probs (2 NaN and 1 inf of 3 values)"


def test_guard_counts_resets_and_stops():
    guard = NonFiniteGuard("actor", limit=3)
    for _ in range(2):
        assert guard.loss_not_finite(torch.tensor(math.nan), [("advantages", torch.tensor([1.0, math.nan]))])
        guard.after_update(False, math.nan)
    guard.after_update(True, 1.0)  # a finite update: the count starts again
    assert guard.in_a_row == 0
    guard.after_update(False, math.inf)  # the loss was finite, the gradient was not
    guard.loss_not_finite(torch.tensor(math.nan), [("returns", torch.tensor([math.inf]))])
    guard.after_update(False, math.nan)
    with pytest.raises(NonFiniteError, match=r"actor: 3 optimizer updates in a row were skipped .* first non-finite "
                                             r"quantity was the gradient norm \(inf\) while every loss was finite, "
                                             r"in update 4"):
        guard.after_update(False, math.nan)
    never = NonFiniteGuard("actor", limit=0)
    for _ in range(50):
        never.after_update(False, math.nan)
    assert never.in_a_row == 50


@pytest.fixture(scope="module")
def rollouts(tiny_model_dir, tiny_tokenizer):
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    engine = TransformersGenerate(model, tiny_tokenizer, device=CPU, dtype=torch.float32)
    batch = engine.generate(prompts_batch(tiny_tokenizer, ["1+2=", "33+44=", "5+5="]),
                            SamplingParams(n=2, max_new_tokens=5))
    B, L = batch["responses"].shape
    batch["advantages"] = torch.randn(B, L) * batch["response_mask"]
    batch["old_log_probs"] = torch.randn(B, L) * 0.1 - 2
    batch["values"] = torch.zeros(B, L)
    batch["returns"] = torch.randn(B, L) * batch["response_mask"]
    return batch


def with_nan(batch, key):
    out = batch.select(list(range(len(batch))))
    t = out[key].clone()
    t[1, 0] = math.nan  # the first response token is always inside the mask
    out[key] = t
    return out


def make_actor(tiny_model_dir, limit):
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    model = PolicyModel(load_causal_lm(str(tiny_model_dir), device=CPU))
    return Actor(ModelRunner(model, Parallel(), dtype=torch.float32), cfg.actor_rollout_ref.actor, temperature=1.0,
                 max_response_length=5, total_steps=10, max_nonfinite_in_a_row=limit)


def weights(module):
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


@pytest.mark.parametrize("key", ["advantages", "old_log_probs"])
def test_actor_skips_counts_and_stops_naming_the_input(tiny_model_dir, rollouts, key):
    actor = make_actor(tiny_model_dir, limit=2)
    before = weights(actor.model)
    metrics = actor.update(with_nan(rollouts, key))
    assert torch.equal(weights(actor.model), before)  # skipped: no NaN reached the weights
    assert actor.skipped_steps == 1 and metrics["actor/skipped_steps"] == 1.0
    # NaN advantages reach the gradient; NaN old log-probs may not (the clipped ratio's branch is cut), yet the
    # loss is NaN: both are skipped
    actor.update(rollouts)  # a finite update steps and resets the count
    assert not torch.equal(weights(actor.model), before) and actor.nonfinite.in_a_row == 0
    actor.update(with_nan(rollouts, key))
    with pytest.raises(NonFiniteError, match=rf"actor: 2 optimizer updates in a row .* first non-finite quantity was "
                                             rf"{key} \(1 NaN of \d+ values\), in update 3"):
        actor.update(with_nan(rollouts, key))
    assert actor.skipped_steps == 3


def test_actor_metrics_count_skipped_and_empty_updates(tiny_model_dir, rollouts):
    """Three updates per step (one prompt group each): `actor/skipped_steps` is the run's total of skipped updates
    and `actor/empty_mini_batches` the step's number of updates without a response token (0 when none)."""
    from posttrain.roles.common import group_rows

    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                             "actor_rollout_ref.actor.shuffle=False"])
    policy = PolicyModel(load_causal_lm(str(tiny_model_dir), device=CPU))
    actor = Actor(ModelRunner(policy, Parallel(), dtype=torch.float32),
                  cfg.actor_rollout_ref.actor, temperature=1.0, max_response_length=5, total_steps=10,
                  max_nonfinite_in_a_row=0)
    groups = group_rows(rollouts.meta["uid"])
    assert len(groups) == 3
    last_nan = rollouts.select(list(range(len(rollouts))))
    last_nan["advantages"] = last_nan["advantages"].clone()
    last_nan["advantages"][groups[2][0], 0] = math.nan  # only the step's last update is skipped
    metrics = actor.update(last_nan)
    assert metrics["actor/skipped_steps"] == 1.0 and metrics["actor/empty_mini_batches"] == 0.0
    two_empty = rollouts.select(list(range(len(rollouts))))
    two_empty["response_mask"] = two_empty["response_mask"].clone()
    two_empty["response_mask"][groups[0] + groups[1]] = 0
    metrics = actor.update(two_empty)
    assert metrics["actor/empty_mini_batches"] == 2.0 and metrics["actor/skipped_steps"] == 1.0
    actor.update(with_nan(rollouts, "advantages"))
    assert actor.update(rollouts)["actor/skipped_steps"] == 2.0


def test_actor_names_the_log_probs_when_the_model_outputs_nan(tiny_model_dir, rollouts):
    actor = make_actor(tiny_model_dir, limit=1)
    with torch.no_grad():
        actor.model.lm.lm_head.weight[:, 0] = math.nan
    with pytest.raises(NonFiniteError, match=r"first non-finite quantity was log_probs \("):
        actor.update(rollouts)


def test_critic_skips_and_names_the_returns(tiny_model_dir, rollouts):
    cfg = load_config(None, ["critic.optim.lr=1e-2"])
    critic = Critic(ModelRunner(ValueModel.from_pretrained(str(tiny_model_dir)), Parallel(), dtype=torch.float32),
                    cfg.critic, cfg.actor_rollout_ref.actor, max_response_length=5, total_steps=10,
                    max_nonfinite_in_a_row=2)
    before = weights(critic.model)
    critic.update(with_nan(rollouts, "returns"))
    assert torch.equal(weights(critic.model), before)
    with pytest.raises(NonFiniteError, match=r"critic: 2 optimizer updates .* was returns \(1 NaN"):
        critic.update(with_nan(rollouts, "returns"))


def test_rl_run_stops_with_exit_code_1_and_the_quantity(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """End to end: NaN advantages every step; the trainer's limit (trainer.max_nonfinite_updates_in_a_row) stops the
    run at the second step, and the command line says why without a traceback."""
    import posttrain.trainer.rl as rl
    from posttrain.cli import main

    real = rl.compute_advantage

    def nan_advantages(*args, **kwargs):
        adv, ret = real(*args, **kwargs)
        return torch.full_like(adv, math.nan), ret

    monkeypatch.setattr(rl, "compute_advantage", nan_advantages)
    from posttrain.data.synthetic import write_task

    files = write_task(tmp_path / "data", operands=range(0, 4), held_out=0, dev=2)
    run = tmp_path / "run"
    argv = ["train", "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "data.max_prompt_length=32",
            "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={files['rl_train']}",
            "trainer.total_training_steps=5", "trainer.logger=['jsonl']", "trainer.val_before_train=False",
            f"trainer.default_local_dir={run}", "trainer.max_nonfinite_updates_in_a_row=2"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: actor: 2 optimizer updates in a row were skipped" in err and "advantages (" in err
    assert "Traceback" not in err
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1] and steps[0]["actor/skipped_steps"] == 1.0


def test_sft_stops_on_nan_loss(tiny_model_dir, tmp_path, capsys):
    from posttrain.cli import main
    from posttrain.data.synthetic import write_task

    model = load_causal_lm(str(tiny_model_dir), device=CPU)
    with torch.no_grad():
        model.lm_head.weight[:, 0] = math.nan
    model.save_pretrained(tmp_path / "nan_model")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).is_file():
            (tmp_path / "nan_model" / name).write_bytes((tiny_model_dir / name).read_bytes())
    files = write_task(tmp_path / "data", operands=range(0, 4), held_out=0, dev=2)
    argv = ["sft", "--model", str(tmp_path / "nan_model"), "--train-files", str(files["sft_train"]),
            "--output-dir", str(tmp_path / "out"), "--batch-size", "4", "--max-nonfinite-updates-in-a-row", "3"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: sft: 3 optimizer updates in a row were skipped" in err and "was loss (1 NaN of 1 value)" in err
