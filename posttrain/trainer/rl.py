"""RLTrainer.fit(): generate -> reward -> log-probs -> advantages -> update -> metrics, one readable loop."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..algo import compute_advantage, estimator_info, make_kl_controller
from ..algo.kl import apply_kl_in_reward
from ..config import ConfigError, to_yaml
from ..data.batch import Batch
from ..data.dataset import RLDataset, batches_per_epoch, collate_prompts, epoch_batches
from ..models.load import compute_dtype, load_causal_lm, load_tokenizer, pick_device
from ..reward.manager import RewardManager
from ..reward.registry import extract_answer_for
from ..roles.actor import Actor
from ..roles.critic import Critic, ValueModel
from ..roles.reference import Reference
from ..rollout.base import SamplingParams
from ..rollout.hf import HFRollout, concat_rollouts
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .metrics import data_metrics, validation_metrics
from .tracking import Tracker


def preflight(cfg) -> None:
    """Settings the loop cannot run yet, rejected before any model is loaded."""
    model = cfg.actor_rollout_ref.model
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("started as several processes (WORLD_SIZE > 1, e.g. by torchrun): training in more than "
                          "one process is not available yet; start posttrain as one process")
    if not model.path:
        raise ConfigError("actor_rollout_ref.model.path is required (a local Hugging Face model directory)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is required")


def _to_batch(items, pad_id: int, uid_prefix: str) -> Batch:
    prompts, prompt_mask = collate_prompts(items, pad_id)
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask},
                 {"uid": [f"{uid_prefix}-{i}" for i in range(len(items))],
                  "data_source": [it.data_source for it in items], "ground_truth": [it.ground_truth for it in items],
                  "extra_info": [it.extra_info for it in items], "raw_prompt": [it.raw_prompt for it in items]})


class RLTrainer:
    def __init__(self, cfg):
        preflight(cfg)
        self.cfg = cfg
        arr, tr = cfg.actor_rollout_ref, cfg.trainer
        torch.manual_seed(tr.seed)
        self.device = pick_device(tr.device)
        self.dtype = compute_dtype(arr.model.dtype, self.device)
        self.tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path, arr.model.trust_remote_code)
        data_kwargs = dict(prompt_key=cfg.data.prompt_key, reward_fn_key=cfg.data.reward_fn_key,
                           max_prompt_length=cfg.data.max_prompt_length,
                           filter_overlong_prompts=cfg.data.filter_overlong_prompts, truncation=cfg.data.truncation,
                           return_raw_chat=cfg.data.return_raw_chat, image_key=cfg.data.image_key)
        self.train_data = RLDataset(cfg.data.train_files, self.tokenizer, **data_kwargs)
        self.val_data = RLDataset(cfg.data.val_files, self.tokenizer, **data_kwargs) if cfg.data.val_files else None
        if len(self.train_data) < cfg.data.train_batch_size:
            raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the training set "
                              f"({len(self.train_data)} prompts)")
        self.steps_per_epoch = batches_per_epoch(len(self.train_data), cfg.data.train_batch_size)
        self.total_steps = tr.total_training_steps or self.steps_per_epoch * tr.total_epochs

        model = load_causal_lm(arr.model.path, device=self.device, trust_remote_code=arr.model.trust_remote_code,
                               override_config=arr.model.override_config,
                               gradient_checkpointing=arr.model.enable_gradient_checkpointing)
        temperature = arr.rollout.temperature if arr.rollout.temperature > 0 else 1.0
        self.actor = Actor(model, arr.actor, device=self.device, dtype=self.dtype, temperature=temperature,
                           n=arr.rollout.n, max_response_length=cfg.data.max_response_length,
                           total_steps=self.total_steps, seed=tr.seed)
        self.use_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.reference = Reference(model, arr.ref, device=self.device, dtype=self.dtype,
                                   temperature=temperature) if self.use_ref else None
        self.critic = None
        if estimator_info(cfg.algorithm.adv_estimator).needs_critic or cfg.critic.enable:
            cm = cfg.critic.model
            value_model = ValueModel.from_pretrained(cm.path or arr.model.path, device=self.device,
                                                     trust_remote_code=cm.trust_remote_code,
                                                     override_config=cm.override_config,
                                                     gradient_checkpointing=cm.enable_gradient_checkpointing)
            self.critic = Critic(value_model, cfg.critic, arr.actor, device=self.device, dtype=self.dtype,
                                 n=arr.rollout.n, max_response_length=cfg.data.max_response_length,
                                 total_steps=self.total_steps, seed=tr.seed)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.reward = RewardManager.from_config(cfg, self.tokenizer)
        for data in (self.train_data, self.val_data):
            if data is not None:
                self.reward.check_data_sources(it.data_source for it in data.items)
        self.rollout = HFRollout(model, self.tokenizer, device=self.device,
                                 dtype=compute_dtype(arr.rollout.dtype, self.device),
                                 micro_batch_size=arr.rollout.micro_batch_size)
        r = arr.rollout
        self.max_new = r.response_length or cfg.data.max_response_length
        self.sampling = SamplingParams.of(r, max_new_tokens=self.max_new, ignore_eos=r.ignore_eos)
        self.val_sampling = SamplingParams.of(r.val_kwargs, max_new_tokens=self.max_new, ignore_eos=r.ignore_eos)
        a = arr.actor
        self.needs_old_log_prob = (a.ppo_epochs > 1 or a.ppo_mini_batch_size < cfg.data.train_batch_size
                                   or cfg.algorithm.use_kl_in_reward or r.calculate_log_probs)
        self.run_dir = Path(tr.default_local_dir or f"checkpoints/{tr.project_name}/{tr.experiment_name}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.global_step = 0
        self.data_cursor = 0  # batches of prompts drawn so far (dynamic sampling draws more than one per step)

    # ------------------------------------------------------------------ the step

    def _generate_scored(self, items, uid_prefix: str, timing: dict) -> Batch:
        """Sample `n` responses per prompt, add the ReMax greedy baseline if needed, and score them; the reward
        extras travel in `meta` under `reward:<name>` so they follow any later row selection."""
        batch = _to_batch(items, self.rollout.pad_id, uid_prefix)
        with _timer(timing, "gen"):
            batch = self.rollout.generate(batch, self.sampling)
        if estimator_info(self.cfg.algorithm.adv_estimator).needs_greedy_baseline:
            with _timer(timing, "gen_greedy"):
                greedy = self.rollout.generate(_to_batch(items, self.rollout.pad_id, "greedy"),
                                               SamplingParams(n=1, do_sample=False, max_new_tokens=self.max_new))
                baseline, _ = self.reward(greedy)
                batch["reward_baselines"] = baseline.sum(-1).repeat_interleave(self.sampling.n)
        with _timer(timing, "reward"):
            batch["token_level_scores"], extras = self.reward(batch)
        batch.meta.update({f"reward:{k}": v for k, v in extras.items()})
        return batch

    def _rollout(self, timing: dict) -> tuple[Batch, dict]:
        """One training batch of scored rollouts. With DAPO dynamic sampling, groups whose metric does not vary
        are dropped and more prompts are generated until the batch is full or max_num_gen_batches is reached."""
        fg, want = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        torch.manual_seed(self.cfg.trainer.seed * 1_000_003 + self.global_step)
        if not fg.enable:
            return self._generate_scored(self._next_items(), f"s{self.global_step}", timing), {}
        kept, n_prompts, n_gen = [], 0, 0
        while n_prompts < want:
            n_gen += 1
            batch = self._generate_scored(self._next_items(), f"s{self.global_step}g{n_gen}", timing)
            # acc: correct or not; score / seq_reward / seq_final_reward: the sequence reward incl. shaping
            metric = batch.meta["reward:acc"] if fg.metric == "acc" else batch["token_level_scores"].sum(-1).tolist()
            groups: dict = {}
            for i, (uid, value) in enumerate(zip(batch.meta["uid"], metric)):
                groups.setdefault(uid, []).append((i, value))
            varied = [[i for i, _ in g] for g in groups.values() if len({v for _, v in g}) > 1]
            take = varied[: want - n_prompts]
            if take:
                kept.append(batch.select([i for g in take for i in g]))
                n_prompts += len(take)
            if 0 < fg.max_num_gen_batches <= n_gen:
                break
        if not kept:  # every group was uniform up to the cap: train on the last batch (its advantages are 0)
            kept, n_prompts = [batch], want
        out = concat_rollouts(kept, self.rollout.pad_id)
        return out, {"batch/num_gen_batches": n_gen, "batch/kept_prompts": n_prompts}

    def train_step(self) -> dict[str, float]:
        cfg, timing = self.cfg, {}
        t_step = time.perf_counter()
        batch, metrics = self._rollout(timing)
        if self.needs_old_log_prob:
            with _timer(timing, "old_log_prob"):
                r = cfg.actor_rollout_ref.rollout
                batch["old_log_probs"], _ = self.actor.compute_log_prob(
                    batch, micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
                    max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None)
        if self.reference is not None:
            with _timer(timing, "ref"):
                batch["ref_log_probs"] = self.reference.compute_log_prob(batch)
        if self.critic is not None:
            with _timer(timing, "values"):
                batch["values"] = self.critic.compute_values(batch)
        with _timer(timing, "adv"):
            if cfg.algorithm.use_kl_in_reward:
                batch["token_level_rewards"], kl_metrics = apply_kl_in_reward(
                    batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"], batch["response_mask"],
                    self.kl_ctrl, cfg.algorithm.kl_penalty)
                metrics |= kl_metrics
            else:
                batch["token_level_rewards"] = batch["token_level_scores"]
            batch["advantages"], batch["returns"] = compute_advantage(
                cfg.algorithm.adv_estimator, token_level_rewards=batch["token_level_rewards"],
                response_mask=batch["response_mask"].float(), index=batch.meta["uid"], values=batch.get("values"),
                reward_baselines=batch.get("reward_baselines"), gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo)
        if self.critic is not None:
            with _timer(timing, "update_critic"):
                metrics |= self.critic.update(batch)
        if self.global_step > cfg.trainer.critic_warmup:
            with _timer(timing, "update_actor"):
                metrics |= self.actor.update(batch)
        timing["step"] = time.perf_counter() - t_step
        metrics |= data_metrics(batch, self.max_new)
        for key, values in batch.meta.items():
            if not key.startswith("reward:") or key in ("reward:score", "reward:response_text"):
                continue
            name = key.split(":", 1)[1]
            if name in ("errors", "timeouts"):
                metrics[f"reward/{name}"] = sum(values)
            elif values and isinstance(values[0], float):
                metrics[f"reward/{name}/mean"] = sum(values) / len(values)
        metrics |= {f"timing_s/{k}": v for k, v in timing.items()}
        metrics["perf/throughput"] = int(batch["attention_mask"].sum()) / timing["step"]
        if cfg.trainer.rollout_data_dir:
            self._dump(Path(cfg.trainer.rollout_data_dir) / f"{self.global_step}.jsonl", batch)
        return metrics

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        if self.val_data is None:
            return {}
        chunk = self.cfg.data.val_batch_size or len(self.val_data)
        sources, uids, scores, answers, samples = [], [], [], [], []
        for start in range(0, len(self.val_data), chunk):
            items = [self.val_data[i] for i in range(start, min(start + chunk, len(self.val_data)))]
            torch.manual_seed(self.cfg.trainer.seed + 17 * start)
            batch = self.rollout.generate(_to_batch(items, self.rollout.pad_id, f"v{start}"), self.val_sampling)
            _, extras = self.reward(batch)
            texts = extras["response_text"]
            sources += batch.meta["data_source"]
            uids += batch.meta["uid"]
            scores += extras["score"]
            answers += [_answer(ds, t) for ds, t in zip(batch.meta["data_source"], texts)]
            samples += [{"data_source": ds, "ground_truth": str(gt), "response": t, "score": s}
                        for ds, gt, t, s in zip(batch.meta["data_source"], batch.meta["ground_truth"], texts,
                                                extras["score"])]
        out = validation_metrics(sources, uids, scores, answers)
        tr = self.cfg.trainer
        if tr.log_val_generations:
            for s in samples[: tr.log_val_generations]:
                print(f"[val] score={s['score']:.2f} truth={s['ground_truth']!r} response={s['response'][:200]!r}")
        if tr.validation_data_dir:
            path = Path(tr.validation_data_dir) / f"{self.global_step}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))
        return out

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        cfg, tr = self.cfg, self.cfg.trainer
        self._maybe_resume()
        tracker = Tracker(tr.logger, self.run_dir, self.total_steps, project=tr.project_name, name=tr.experiment_name,
                          resumed_step=self.global_step)
        last_val: dict[str, float] = {}
        try:
            if tr.val_only:  # evaluate the starting point (a resumed checkpoint too) and stop: nothing trains
                last_val = self.validate()
                tracker.log(last_val, self.global_step)
                return last_val
            if tr.val_before_train and self.val_data is not None and self.global_step == 0:
                last_val = self.validate()
                tracker.log(last_val, self.global_step)
            while self.global_step < self.total_steps:
                self.global_step += 1
                metrics = self.train_step()
                done = self.global_step == self.total_steps
                if self.val_data is not None and tr.test_freq > 0 and (self.global_step % tr.test_freq == 0 or done):
                    last_val = self.validate()
                    metrics |= last_val
                tracker.log(metrics, self.global_step)
                tracker.advance(self.global_step)
                if tr.save_freq > 0 and (self.global_step % tr.save_freq == 0 or done):
                    self.save()
        finally:
            tracker.close()
            self.reward.close()
        return last_val

    def _next_items(self):
        """The next batch of prompts; the order depends only on (data.seed, epoch), so a resume replays it."""
        epoch, pos = divmod(self.data_cursor, self.steps_per_epoch)
        self.data_cursor += 1
        d = self.cfg.data
        order = list(epoch_batches(len(self.train_data), d.train_batch_size, shuffle=d.shuffle, seed=d.seed, epoch=epoch))
        return [self.train_data[i] for i in order[pos]]

    @property
    def roles(self) -> dict:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def save(self) -> Path:
        tr = self.cfg.trainer
        return save_checkpoint(self.run_dir, self.global_step, self.roles, tokenizer=self.tokenizer,
                               extra={"kl_ctrl": self.kl_ctrl.state_dict(), "data_cursor": self.data_cursor,
                                      "roles": {name: role.counters() for name, role in self.roles.items()}},
                               contents=self.cfg.actor_rollout_ref.actor.checkpoint.save_contents,
                               keep=min((k for k in (tr.max_actor_ckpt_to_keep, tr.max_critic_ckpt_to_keep) if k),
                                        default=None))

    def _maybe_resume(self) -> None:
        tr = self.cfg.trainer
        if tr.resume_mode == "disable":
            return
        path = Path(tr.resume_from_path) if tr.resume_mode == "resume_path" else latest_checkpoint(self.run_dir)
        if path is None:
            return
        ck = self.cfg.actor_rollout_ref.actor.checkpoint
        extra = load_checkpoint(path, self.roles, contents=ck.load_contents or ck.save_contents)
        self.global_step = int(extra.get("step", int(path.name.rsplit("_", 1)[1])))
        self.data_cursor = int(extra.get("data_cursor", self.global_step))
        if "kl_ctrl" in extra:
            self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        for name, state in extra.get("roles", {}).items():
            self.roles[name].load_counters(state)
        print(f"resumed from {path} at step {self.global_step}")

    @staticmethod
    def _dump(path: Path, batch: Batch) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        m = batch.meta
        rows = [{"uid": u, "data_source": ds, "ground_truth": str(gt), "response": t, "score": s}
                for u, ds, gt, t, s in zip(m["uid"], m["data_source"], m["ground_truth"], m["reward:response_text"],
                                           m["reward:score"])]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _answer(data_source: str, text: str):
    """The extracted final answer for maj@n; None where the source's scorer has no extractor."""
    try:
        return extract_answer_for(data_source, text)
    except (KeyError, ValueError):
        return None


class _timer:
    def __init__(self, store: dict, name: str):
        self.store, self.name = store, name

    def __enter__(self):
        self.t = time.perf_counter()

    def __exit__(self, *exc):
        self.store[self.name] = self.store.get(self.name, 0.0) + time.perf_counter() - self.t


def run_rl(cfg) -> dict[str, float]:
    return RLTrainer(cfg).fit()
