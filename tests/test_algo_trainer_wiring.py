"""The inputs the newer algorithms read, as the engine and trainer produce them: the rollout's sampling log-probs,
sum_pi_squared from the old-log-prob pass, reward components for gdpo, rollout-IS weights, bypass mode. References
are the model's own plain forward and the formulas written out here."""

import json
import math

import pytest
import torch

from posttrain.config import load_config
from posttrain.data.batch import Batch
from posttrain.models.load import load_causal_lm
from posttrain.models.policy import PolicyModel
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.transformers_generate import TransformersGenerate
from posttrain.trainer.rl import RLTrainer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CPU = torch.device("cpu")


def prompts(tok, texts):
    from posttrain.data.dataset import PromptItem, collate_prompts

    chats = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
             for t in texts]
    ids, mask = collate_prompts([PromptItem(c["input_ids"], "synthetic/arithmetic", "0") for c in chats],
                                tok.pad_token_id)
    return Batch({"prompts": ids, "prompt_mask": mask}, {"uid": [str(i) for i in range(len(texts))]})


def sampling_logprobs_reference(lm, out, s: SamplingParams):
    """log softmax of the filtered (temperature, top-k) logits of the plain forward, at the sampled tokens."""
    ids, mask = out["input_ids"], out["attention_mask"]
    L = out["responses"].shape[1]
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    z = logits[:, -(L + 1):-1].double() / s.temperature
    if s.top_k > 0:
        kth = z.topk(s.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    lp = torch.log_softmax(z, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    return torch.where(out["response_mask"].bool(), lp, torch.zeros_like(lp))  # padding may be outside top-k


@pytest.mark.parametrize("engine", [DecodeEngine, TransformersGenerate])
@pytest.mark.parametrize("top_k", [-1, 7])
def test_engines_return_the_sampling_log_probs(tiny_model_dir, tiny_tokenizer, engine, top_k):
    lm = load_causal_lm(str(tiny_model_dir))
    rollout = engine(PolicyModel(lm), tiny_tokenizer, device=CPU, dtype=torch.float32)
    s = SamplingParams(n=3, temperature=0.7, top_k=top_k, max_new_tokens=6, logprobs=True)
    torch.manual_seed(0)
    out = rollout.generate(prompts(tiny_tokenizer, ["1+2=", "33+44=", "7+7="]), s)
    expected = sampling_logprobs_reference(lm, out, s)
    assert out["rollout_log_probs"].shape == out["responses"].shape
    assert torch.allclose(out["rollout_log_probs"].double(), expected, atol=2e-5)
    assert "rollout_log_probs" not in rollout.generate(prompts(tiny_tokenizer, ["1+2="]),
                                                       SamplingParams(n=1, max_new_tokens=3)).tensors


def run_config(out, files, run, *extra):
    return load_config(None, [
        "data.train_batch_size=12", "data.max_prompt_length=32", "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.model.path={out / 'sft'}", f"data.train_files={files['rl_train']}",
        "trainer.total_training_steps=2", f"trainer.default_local_dir={out / run}", "trainer.logger=['jsonl']",
        "trainer.val_before_train=False", *extra])


def test_sum_pi_squared_and_rollout_is_weights_in_a_training_run(small_task):
    out, files = small_task
    cfg = run_config(out, files, "otb_tis", "algorithm.adv_estimator=optimal_token_baseline",
                     "algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.temperature=0.8",
                     "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32")
    trainer = RLTrainer(cfg)
    batch, _ = trainer._training_batch({})
    assert "rollout_log_probs" in batch
    old, sps = trainer.parts.actor.compute_log_prob(batch, sum_pi_squared=True)
    lm = trainer.parts.actor.model.lm
    ids, mask, L = batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]
    with torch.no_grad():
        z = lm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    p = torch.softmax(z[:, -(L + 1):-1].double() / 0.8, -1)
    m = batch["response_mask"].double()
    assert torch.allclose(sps.double() * m, (p * p).sum(-1) * m, atol=1e-5)
    # on-policy in fp32: the rollout's log-probs are the trainer's, so the IS weights are 1
    assert torch.allclose(batch["rollout_log_probs"].double() * m, old.double() * m, atol=1e-4)
    metrics = trainer.learn(batch)
    assert abs(metrics["rollout_corr/rollout_is_mean"] - 1.0) < 1e-3 and abs(metrics["rollout_corr/kl"]) < 1e-4
    assert torch.allclose(batch["rollout_is_weights"].double(), m, atol=1e-3)
    assert "sum_pi_squared" in batch and torch.isfinite(batch["advantages"]).all()


def test_calculate_log_probs_logs_the_rollout_probability_gap(small_task):
    """rollout.calculate_log_probs: the step's metrics hold the gap between the engine's and the trainer's token
    probabilities, computed from the two log-probs the run produced (about 0 on-policy in fp32)."""
    out, files = small_task
    cfg = run_config(out, files, "calc_logp", "algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.model.dtype=fp32",
                     "actor_rollout_ref.rollout.dtype=fp32")
    trainer = RLTrainer(cfg)
    batch, _ = trainer._training_batch({})
    metrics = trainer.learn(batch)
    diffs = [abs(math.exp(o) - math.exp(r))
             for orow, rrow, mrow in zip(batch["old_log_probs"].tolist(), batch["rollout_log_probs"].tolist(),
                                         batch["response_mask"].tolist())
             for o, r, keep in zip(orow, rrow, mrow) if keep]
    assert metrics["training/rollout_probs_diff_valid"] == 1.0
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(max(diffs), abs=1e-9)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-9)
    assert metrics["training/rollout_probs_diff_max"] < 1e-4


def test_gdpo_reads_the_reward_components_and_bypass_mode_skips_the_old_pass(small_task):
    out, files = small_task
    cfg = run_config(out, files, "gdpo_bypass", "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[score,acc]",
                     "algorithm.gdpo_reward_weights=[1.0,0.5]", "algorithm.rollout_correction.bypass_mode=True")
    trainer = RLTrainer(cfg)
    assert not trainer.parts.needs_old_log_prob
    batch, _ = trainer._training_batch({})
    comps = trainer._reward_components(batch)
    assert comps.tolist() == [[s, a] for s, a in zip(batch.meta["reward:score"], batch.meta["reward:acc"])]
    trainer.learn(batch)
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    trainer.fit()
    assert len((out / "gdpo_bypass" / "metrics.jsonl").read_text().splitlines()) == 2
    bad = RLTrainer(run_config(out, files, "gdpo_bad", "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[fmt]"))
    with pytest.raises(Exception, match="returned no such key"):
        bad.learn(bad._training_batch({})[0])


def test_new_losses_train_a_step(small_task):
    out, files = small_task
    for loss in ("clip_cov", "kl_cov", "geo_mean", "sapo", "dppo_tv", "dppo_kl"):
        run = f"loss_{loss}"
        RLTrainer(run_config(out, files, run, "algorithm.adv_estimator=grpo",
                             f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}",
                             "trainer.total_training_steps=1")).fit()
        metrics = json.loads((out / run / "metrics.jsonl").read_text().splitlines()[0])
        assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("actor/pg_loss", "actor/grad_norm")), loss


def three_prompt_config(tmp_path, tiny_model_dir, scorer_body: str, extra: list[str]):
    """A 1-step run's config on three prompts `a+a=` x 2 responses of exactly 5 tokens, scored by a custom
    `compute_score` whose body is `scorer_body`, with `extra` overrides."""
    from posttrain.data.dataset import layout_row

    rows = [layout_row("synthetic/arithmetic", f"{a}+{a}=", str(2 * a), {"index": a}) for a in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(f"def compute_score(*args):\n    {scorer_body}\n")
    return load_config(None, [
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path / 'train.jsonl'}",
        "data.train_batch_size=3", "data.max_prompt_length=32", "data.max_response_length=5",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.ignore_eos=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=3", f"custom_reward_function.path={tmp_path / 'reward.py'}",
        "reward_model.num_workers=0", "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.logger=['jsonl']", "trainer.val_before_train=False", *extra])


def test_remax_greedy_baseline_keeps_ignore_eos_and_counts_its_scoring_errors(tmp_path, tiny_model_dir):
    """ReMax's greedy baseline rollout decodes with the rollout's `ignore_eos` (full-length responses, as the
    sampled ones), and a greedy response that fails to score is counted in `reward/errors` like a sampled one; the
    error-rate check counts the greedy responses in its total (all failing is a rate of 1, which
    `max_error_rate=1` allows)."""
    cfg = three_prompt_config(tmp_path, tiny_model_dir, "raise ValueError('always')", [
        "algorithm.adv_estimator=remax", "reward_model.max_error_rate=1"])
    trainer = RLTrainer(cfg)
    calls = []
    generate = trainer.parts.engine.generate

    def recorded(batch, sampling):
        out = generate(batch, sampling)
        calls.append((sampling, out["response_mask"].sum(-1).tolist()))
        return out

    trainer.parts.engine.generate = recorded
    with pytest.warns(RuntimeWarning, match="reward function raised"):
        batch, _ = trainer._training_batch({})
    (sampled, sampled_lengths), (greedy, greedy_lengths) = calls
    assert greedy.greedy and greedy.n == 1 and greedy.ignore_eos
    assert sampled_lengths == [5] * 6 and greedy_lengths == [5] * 3
    metrics = trainer.learn(batch)
    assert metrics["reward/errors"] == 6 + 3  # 3 prompts x 2 sampled responses, and the 3 greedy ones
    trainer.parts.reward.close()


def test_dapo_filter_metrics_follow_verls_definitions(tmp_path, tiny_model_dir):
    """DAPO's group filter compares, per algorithm.filter_groups.metric: `score` the scorer's own score (groups tied
    on it are dropped even when overlong shaping makes their rewards differ), `seq_reward` the summed token-level
    scores (shaping included), `seq_final_reward` the summed token-level rewards (the in-reward KL penalty
    subtracted, so groups tied on the scores are kept when the KL differs). Every response scores 1.0 here."""
    from posttrain.models.load import load_causal_lm

    cfg = three_prompt_config(tmp_path, tiny_model_dir, "return 1.0", [
        "algorithm.adv_estimator=grpo",
        "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=score",
        "algorithm.filter_groups.max_num_gen_batches=2", "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.kl_coef=0.5", "algorithm.kl_penalty=kl",
        "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4",  # penalty -(len - 1) / 4
        "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"])
    trainer = RLTrainer(cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # the policy moves away from the reference: the in-reward KL differs by response
        for p in trainer.parts.actor.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    generate, lengths = trainer.parts.engine.generate, []

    def with_lengths(batch, sampling):  # responses that ended early at the given lengths (all of them 5 if none)
        out = generate(batch, sampling)
        if lengths and sampling.n > 1:
            m = (torch.arange(5) < torch.tensor(lengths)[:, None]).to(out["response_mask"].dtype)
            out["response_mask"], out["attention_mask"] = m, torch.cat([out["prompt_mask"], m], 1)
        return out

    trainer.parts.engine.generate = with_lengths

    def rounds(metric, response_lengths=()):
        cfg.algorithm.filter_groups.metric = metric
        lengths[:] = response_lengths
        return trainer._training_batch({})[1]["batch/num_gen_batches"]

    varied = [2, 5, 3, 5, 1, 4]  # within each group the lengths (so the overlong penalties) differ
    assert rounds("score", varied) == 2  # tied on the score: every group dropped, up to the cap
    assert rounds("acc", varied) == 2
    assert rounds("seq_reward", varied) == 1  # the shaped scores differ: kept at once
    assert rounds("seq_reward") == 2  # full length: every score is 1 - 1
    assert rounds("seq_final_reward") == 1  # the KL penalty differs: kept at once

    # seq_final_reward's values: 1 + overlong penalty - beta * sum_t (logp_actor - logp_ref), re-derived in float64
    batch = trainer._generate_scored(trainer._next_items(), "check", {})
    ids, mask, L = batch["input_ids"], batch["attention_mask"], batch["responses"].shape[1]

    def logp(lm):
        with torch.no_grad():
            z = lm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        lp = torch.log_softmax(z[:, -(L + 1):-1].double(), -1)
        return lp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)

    m = batch["response_mask"].double()
    kl = ((logp(trainer.parts.actor.model.lm) - logp(load_causal_lm(str(tiny_model_dir)))) * m).sum(-1)
    shaped = [1.0 - (int(n) - 1) / 4 for n in batch["response_mask"].sum(-1)]
    assert kl.abs().min() > 1e-3
    cfg.algorithm.filter_groups.metric = "seq_final_reward"
    assert trainer._filter_metric(batch) == pytest.approx([s - 0.5 * k for s, k in zip(shaped, kl.tolist())], abs=1e-4)
    trainer.parts.reward.close()


def test_decoupled_objective_masks_stale_tokens_and_logs_staleness(tmp_path, tiny_model_dir):
    """rollout_is=token with rollout_is_mode=mask: tokens whose behaviour weight pi_old / pi_rollout exceeds the
    threshold get weight 0 in the step's batch; a batch carrying rollout_versions logs its staleness against the
    trainer's version, and learn() without that version is refused."""
    cfg = three_prompt_config(tmp_path, tiny_model_dir, "return float(len(args[1]) % 2)", [
        "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_mode=mask", "algorithm.rollout_correction.rollout_is_threshold=1.5",
        "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"])
    trainer = RLTrainer(cfg)
    batch, _ = trainer._training_batch({})
    m = batch["response_mask"]
    stale = torch.zeros_like(m, dtype=torch.bool)
    stale[:, 0] = True  # a stale sampler: these tokens were 1 nat less likely under it (weight e^1 > 1.5)
    batch["rollout_log_probs"] = batch["rollout_log_probs"] - stale.float()
    batch["rollout_versions"] = torch.where(stale, 2, 4) * m
    with pytest.raises(ValueError, match="trainer_version"):
        trainer.learn(batch)
    metrics = trainer.learn(batch, trainer_version=4)
    w, keep = batch["rollout_is_weights"], m.bool()
    assert (w[stale & keep] == 0).all() and torch.allclose(w[~stale & keep], torch.ones(()), atol=1e-3)
    share = float((stale & keep).sum() / keep.sum())
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(share, abs=1e-6)
    assert metrics["async/staleness_max"] == 2.0 and metrics["async/staleness_mean"] == pytest.approx(2 * share)
    assert metrics["async/staleness_le_0"] == pytest.approx(1 - share) and metrics["async/staleness_le_2"] == 1.0


def test_rejection_sampling_takes_rejected_tokens_out_of_the_response_mask(tmp_path, tiny_model_dir):
    """rollout_rs=token_k1 (0.6_1.6), not in bypass mode: a token whose rollout log-prob is 1 nat above the
    trainer's (k1 = 1 > log 1.6) leaves the response mask before the advantages and the update, as in verl, while
    the forwards still attend to it (the original mask becomes response_attention_mask); the step trains."""
    cfg = three_prompt_config(tmp_path, tiny_model_dir, "return float(len(args[1]) % 2)", [
        "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.6_1.6",
        "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"])
    trainer = RLTrainer(cfg)
    batch, _ = trainer._training_batch({})
    m = batch["response_mask"].clone()
    off = torch.zeros_like(m, dtype=torch.bool)
    off[:, 1] = True
    batch["rollout_log_probs"] = batch["rollout_log_probs"] + off.float()
    trainer.global_step = 1  # past critic_warmup: the actor updates
    metrics = trainer.learn(batch)
    assert torch.equal(batch["response_attention_mask"], m)
    assert torch.equal(batch["response_mask"].bool(), m.bool() & ~off)
    assert (batch["advantages"][off & m.bool()] == 0).all()
    share = float((off & m.bool()).sum() / m.sum())
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(share, abs=1e-6)
    assert math.isfinite(metrics["actor/pg_loss"])


def test_bypass_mode_rejection_sampling_drops_tokens_from_the_policy_loss_only(tmp_path, tiny_model_dir):
    """bypass_mode with rollout_rs (verl judges in the loss, against the current policy): tokens whose rollout
    log-prob is 1 nat above the current policy's (k1 = 1 > log 1.6) add nothing to the policy loss, which keeps the
    mini-batch's token count as normaliser: the same update from the same weights with those tokens' advantages set
    to 0 instead gives the same pg_loss; the response mask itself is unchanged."""
    keys = ["algorithm.adv_estimator=grpo", "algorithm.rollout_correction.bypass_mode=True",
            "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"]
    rs = ["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=0.6_1.6"]
    score = "return float(len(args[1]) % 2)"
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    trainer = RLTrainer(three_prompt_config(tmp_path / "a", tiny_model_dir, score, keys + rs))
    batch, _ = trainer._training_batch({})
    m = batch["response_mask"].clone()
    off = torch.zeros_like(m, dtype=torch.bool)
    off[:, 1] = True
    batch["rollout_log_probs"] = batch["rollout_log_probs"] + off.float()
    trainer._rollout_correction(batch)  # bypass: the rollout's log-probs are the old policy's
    batch["advantages"] = (torch.randn(m.shape, generator=torch.Generator().manual_seed(0)) + 0.5) * m
    metrics = trainer.parts.actor.update(batch)
    assert torch.equal(batch["response_mask"], m)
    share = float((off & m.bool()).sum() / m.sum())
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(share, abs=1e-6)
    plain = RLTrainer(three_prompt_config(tmp_path / "b", tiny_model_dir, score, keys))
    zeroed = batch.select(list(range(len(batch))))
    zeroed["advantages"] = batch["advantages"] * ~off
    expected = plain.parts.actor.update(zeroed)
    assert metrics["actor/pg_loss"] == pytest.approx(expected["actor/pg_loss"], rel=1e-5)
    assert abs(metrics["actor/pg_loss"]) > 0.05


def test_teachers_route_rows_by_their_key_and_refuse_a_row_without_one():
    """Several teachers: a row goes to the teacher whose key equals its `teacher_key` field; a row naming no
    teacher, or rows without that field, stop the step with the values and keys in the message."""
    from posttrain.roles.teacher import Teachers

    teachers = Teachers.__new__(Teachers)  # routing only: no models
    teachers.teachers, teachers.keys = {"a": None, "b": None}, {"a": "x", "b": "y"}
    teachers.teacher_key, teachers.topk = "data_source", 0
    assert teachers.rows_of(Batch(meta={"data_source": ["y", "x", "y"]})) == {"a": [1], "b": [0, 2]}
    with pytest.raises(KeyError, match=r"data_source=\['z'\] have no teacher"):
        teachers.rows_of(Batch(meta={"data_source": ["x", "z"]}))
    with pytest.raises(KeyError, match="carry no such field"):
        teachers.rows_of(Batch(meta={"uid": ["u"]}))


def test_distillation_teacher_scores_in_learn_and_trains_a_step(small_task):
    """A teacher that is the student's own checkpoint (fp32) gives the student's log-probs: its scores in `learn`
    equal the old log-probs, and the first mini-batch's k3 divergence is 0. A top-k run trains a step through
    fit() and logs the masses, the teacher's time and a finite loss."""
    out, files = small_task
    teacher = f"distillation.teacher_models.teacher_model.model_path={out / 'sft'}"
    fp32 = ["actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"]
    trainer = RLTrainer(run_config(out, files, "opd_self", "algorithm.adv_estimator=grpo", "distillation.enabled=True",
                                   teacher, "distillation.distillation_loss.use_task_rewards=False", *fp32))
    batch, _ = trainer._training_batch({})
    trainer.global_step = 1  # past critic_warmup: the actor updates
    metrics = trainer.learn(batch)
    m = batch["response_mask"].double()
    assert torch.allclose(batch["teacher_log_probs"].double() * m, batch["old_log_probs"].double() * m, atol=1e-5)
    assert 0 <= metrics["actor/distillation/abs_loss"] < 1e-3
    run = "opd_topk"
    RLTrainer(run_config(out, files, run, "algorithm.adv_estimator=grpo", "distillation.enabled=True", teacher,
                         "distillation.distillation_loss.loss_mode=forward_kl_topk",
                         "distillation.distillation_loss.topk=4", "trainer.total_training_steps=1")).fit()
    metrics = json.loads((out / run / "metrics.jsonl").read_text().splitlines()[0])
    assert 0 < metrics["actor/distillation/student_mass"] <= 1 + 1e-4
    assert 0 < metrics["actor/distillation/teacher_mass"] <= 1 + 1e-4 and metrics["timing_s/teacher"] > 0
    assert math.isfinite(metrics["actor/distillation/loss"]) and math.isfinite(metrics["actor/grad_norm"])
