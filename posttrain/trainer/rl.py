"""RLTrainer.fit(): generate -> reward -> log-probs -> advantages -> update -> metrics, one readable loop."""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch

from ..algo import compute_advantage, estimator_info, make_kl_controller
from ..algo.kl import apply_kl_in_reward, kl_penalty
from ..algo.rollout_correction import rollout_is_weights, rollout_probs_diff
from ..config import ConfigError, to_dict, to_yaml
from ..data.batch import Batch
from ..data.dataset import RLDataset, batches_per_epoch, collate_prompts, epoch_batches
from ..models.load import load_tokenizer
from ..models.vision import MM_KEY, load_vision_processor
from ..parallel import Parallel, shutdown
from ..reward import code as code_reward
from ..reward.checks import check_error_rate
from ..reward.manager import RewardManager
from ..reward.judge import judge_reward
from ..reward.model import ModelRewardManager
from ..reward.registry import extract_answer_for
from ..roles.common import group_rows
from ..rollout.base import SamplingParams, concat_rollouts
from .checkpoint import complete_checkpoints, finish_exports, save_checkpoint
from .preempt import Preempted, StopOnSignal, resume_message
from .recovery import check_run_dir, clear_run_dir, load_latest
from .metrics import data_metrics, validation_metrics
from .setup import Roles, model_sources, parallel_for
from .tracking import NullTracker, Tracker


def preflight(cfg) -> None:
    """Settings the loop cannot run with, rejected before any model is loaded."""
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError("actor_rollout_ref.model.path is required (a local Hugging Face model directory or a hub "
                          "id such as Qwen/Qwen2.5-0.5B-Instruct)")
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is required")


def _rule_reward(cfg, tokenizer) -> RewardManager:
    """The rule reward manager; a custom reward file that fails while it is imported is a ConfigError naming it."""
    try:
        return RewardManager.from_config(cfg, tokenizer)
    except Exception as e:
        path = cfg.custom_reward_function.path
        if not path or isinstance(e, ConfigError):
            raise
        where = next((f"line {tb.lineno}" for tb in reversed(traceback.extract_tb(e.__traceback__))
                      if Path(tb.filename).resolve() == Path(path).expanduser().resolve()), "")
        raise ConfigError(f"custom_reward_function.path: importing {path} failed"
                          f"{' at ' + where if where else ''}: {type(e).__name__}: {e}") from None


def _to_batch(items, pad_id: int, uid_prefix: str, first_index: int = 0, *, vision: bool = False) -> Batch:
    """The prompts of `items` as a batch; `vision`: each row's image inputs travel in meta[MM_KEY]."""
    prompts, prompt_mask = collate_prompts(items, pad_id)
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask},
                 {"uid": [f"{uid_prefix}-{first_index + i}" for i in range(len(items))],
                  "data_source": [it.data_source for it in items], "ground_truth": [it.ground_truth for it in items],
                  "extra_info": [it.extra_info for it in items], "raw_prompt": [it.raw_prompt for it in items],
                  **({MM_KEY: [it.images for it in items]} if vision else {})})


class RLTrainer:
    """Every rank runs this same loop. A rank generates and scores its share of the prompts; the scored rollouts
    are then gathered so that every rank holds the step's whole batch (token ids and a few (B, L) tensors), and
    each model pass computes on the rank's share and gathers the result. Advantages, metrics and the loss
    normalisers are therefore computed on the whole batch, and do not depend on the number of processes."""

    def __init__(self, cfg, par: Parallel | None = None):
        preflight(cfg)
        self.cfg = cfg
        self.par = par if par is not None else parallel_for(cfg)
        # A rank of a multi-process job notes SIGTERM/SIGINT from the moment the process group exists, not only once
        # fit() starts: the launcher signals every rank at once, and a rank still setting up (rank 0 can be in the
        # loop while rank 1 is between the barrier below and fit()) would die of the signal's default action; the
        # ranks that noted it then fail in the step's first collective and nothing is saved. A signal noted during
        # setup stops the run after its first step. One process has no peer to lose: it keeps the default until fit().
        self.stop = StopOnSignal().__enter__() if self.par.distributed and self.par.world > 1 else None
        try:
            self._build()
        except BaseException:
            if self.stop is not None:
                self.stop.__exit__()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        arr, tr = cfg.actor_rollout_ref, cfg.trainer
        self.run_dir = Path(tr.default_local_dir or f"checkpoints/{tr.project_name}/{tr.experiment_name}")
        check_run_dir(cfg, self.run_dir)  # before any model loads; rank 0 writes there only further down
        torch.manual_seed(tr.seed)
        sources = model_sources(cfg)  # hub ids fetched before anything loads, on every rank
        tok_key = "actor_rollout_ref.model." + ("tokenizer_path" if arr.model.tokenizer_path else "path")
        self.tokenizer = load_tokenizer(sources[tok_key], arr.model.trust_remote_code, key=tok_key)
        data_kwargs = dict(prompt_key=cfg.data.prompt_key, reward_fn_key=cfg.data.reward_fn_key,
                           max_prompt_length=cfg.data.max_prompt_length,
                           filter_overlong_prompts=cfg.data.filter_overlong_prompts, truncation=cfg.data.truncation,
                           return_raw_chat=cfg.data.return_raw_chat, image_key=cfg.data.image_key,
                           apply_chat_template_kwargs=cfg.data.apply_chat_template_kwargs,
                           missing_chat_template=cfg.data.missing_chat_template,
                           processor=load_vision_processor(sources["actor_rollout_ref.model.path"], self.tokenizer,
                                                           trust_remote_code=arr.model.trust_remote_code))
        self.train_data = RLDataset(cfg.data.train_files, self.tokenizer, max_samples=cfg.data.train_max_samples,
                                    **data_kwargs)
        self.vision = data_kwargs["processor"] is not None
        self.val_data = (RLDataset(cfg.data.val_files, self.tokenizer, max_samples=cfg.data.val_max_samples,
                                   **data_kwargs) if cfg.data.val_files else None)
        for data in (self.train_data, self.val_data):
            for note in data.notes if data is not None and self.par.is_main else ():
                print(f"note: {note}", file=sys.stderr)
        if len(self.train_data) < cfg.data.train_batch_size:
            raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} is larger than the training set "
                              f"({len(self.train_data)} prompts)")
        self.steps_per_epoch = batches_per_epoch(len(self.train_data), cfg.data.train_batch_size)
        self.total_steps = tr.total_training_steps or self.steps_per_epoch * tr.total_epochs

        # rewards before any model loads: a reward file that fails to import, a data source without a scorer or
        # code rows without a sandbox are reported in seconds, not after the models load
        code_reward.configure_from_config(cfg)  # before any scorer process starts: they read it
        self.rule_reward = _rule_reward(cfg, self.tokenizer)  # validation is rule-based (as in verl)
        for data in (self.train_data, self.val_data):
            if data is not None:
                if not cfg.reward_model.enable:
                    self.rule_reward.check_data_sources(it.data_source for it in data.items)
                if not cfg.custom_reward_function.path:  # code rows, no sandbox: refuse before training
                    code_reward.check_ready(it.data_source for it in data.items)

        roles = Roles(cfg, self.par, self.tokenizer, self.total_steps)
        self.actor, self.reference, self.critic, self.rollout = roles.actor, roles.reference, roles.critic, roles.rollout
        self.roles = roles.trained
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
        self.reward = (ModelRewardManager(self.rule_reward, roles.reward_model.score) if roles.reward_model is not None
                       else judge_reward(cfg, self.rule_reward, roles.judge) if roles.judge is not None
                       else self.rule_reward)
        if cfg.reward_model.enable:
            for data in (self.train_data, self.val_data):
                if data is not None:
                    self.reward.check_data_sources(it.data_source for it in data.items)
        if cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc" and not self._rule_scoring:
            raise ConfigError("algorithm.filter_groups.metric=acc needs rule scores, and with reward_model.enable=True "
                              "a data source without a scorer turns them off; use metric=score (the reward model's) or "
                              "set custom_reward_function.path")
        r = arr.rollout
        self.max_new = r.response_length or cfg.data.max_response_length
        rc = cfg.algorithm.rollout_correction
        self.rollout_logprobs = r.calculate_log_probs or rc.rollout_is is not None or rc.bypass_mode
        self.sampling = SamplingParams.of(r, max_new_tokens=self.max_new, ignore_eos=r.ignore_eos,
                                          logprobs=self.rollout_logprobs)
        self.val_sampling = SamplingParams.of(r.val_kwargs, max_new_tokens=self.max_new, ignore_eos=r.ignore_eos)
        a = arr.actor
        self.info = estimator_info(cfg.algorithm.adv_estimator)
        # bypass mode: the rollout's log-probs are the old policy's, so no pass computes them
        self.needs_old_log_prob = self.info.needs_sum_pi_squared or not rc.bypass_mode and (
            a.ppo_epochs > 1 or a.ppo_mini_batch_size < cfg.data.train_batch_size or cfg.algorithm.use_kl_in_reward
            or r.calculate_log_probs or rc.rollout_is is not None)
        self.par.barrier()
        if self.par.is_main:
            if tr.resume_mode == "disable" and tr.overwrite_run_dir:
                clear_run_dir(self.run_dir)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.global_step = 0
        self.preempted: tuple[int, Path] | None = None  # (signal, checkpoint) when a signal stopped the run
        self.data_cursor = 0  # batches of prompts drawn so far (dynamic sampling draws more than one per step)

    @property
    def _rule_scoring(self) -> bool:
        """Whether rule scores exist: always without a reward model; with one, when every row has a scorer."""
        return getattr(self.reward, "rule_scoring", True)

    def _seed(self, base: int) -> None:
        """Sampling noise: the same for the ranks of one tensor-parallel group, different across data ranks."""
        torch.manual_seed((base + 104_729 * self.par.dp_rank) % 2**63)

    # ------------------------------------------------------------------ the step

    def _generate_scored(self, items, uid_prefix: str, timing: dict) -> Batch:
        """Sample `n` responses for this rank's share of `items`, add the ReMax greedy baseline if needed, score
        them, and gather every rank's scored rollouts: the result is the whole batch, the same on every rank. The
        reward extras travel in `meta` under `reward:<name>` so they follow any later row selection."""
        share = self.par.my_slice(len(items))
        batch = _to_batch(items[share], self.rollout.pad_id, uid_prefix, share.start, vision=self.vision)
        n, greedy_extras = self.sampling.n, None
        with _timer(timing, "gen"), self.actor.generation():
            batch = self.rollout.generate(batch, self.sampling)
            if self.info.needs_greedy_baseline:
                greedy = self.rollout.generate(_to_batch(items[share], self.rollout.pad_id, "greedy",
                                                         vision=self.vision),
                                               SamplingParams(n=1, do_sample=False, max_new_tokens=self.max_new,
                                                              ignore_eos=self.sampling.ignore_eos))
                baseline, greedy_extras = self.reward(greedy)
                batch["reward_baselines"] = baseline.sum(-1).repeat_interleave(n)
        with _timer(timing, "reward"):
            batch["token_level_scores"], extras = self.reward(batch)
        if greedy_extras is not None:  # a greedy response that failed to score counts on its prompt's first row
            for key in ("errors", "timeouts"):
                for g, failed in enumerate(greedy_extras[key]):
                    extras[key][g * n] += failed
        batch.meta.update({f"reward:{k}": v for k, v in extras.items()})
        out = concat_rollouts(self.par.gather(batch), self.rollout.pad_id)
        check_error_rate(out.meta.get("reward:errors", []), out.meta.get("reward:timeouts", []),
                         self.cfg.reward_model.max_error_rate,
                         responses=len(out) + (len(out) // n if greedy_extras is not None else 0))
        return out

    def _rollout(self, timing: dict) -> tuple[Batch, dict]:
        """One training batch of scored rollouts. With DAPO dynamic sampling, groups whose metric does not vary
        are dropped and more prompts are generated until the batch is full or max_num_gen_batches is reached (the
        decisions are taken on the gathered batch, so every rank takes the same ones)."""
        fg, want = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        self._seed(self.cfg.trainer.seed * 1_000_003 + self.global_step)
        if not fg.enable:
            return self._generate_scored(self._next_items(), f"s{self.global_step}", timing), {}
        kept, n_prompts, n_gen = [], 0, 0
        while n_prompts < want:
            n_gen += 1
            batch = self._generate_scored(self._next_items(), f"s{self.global_step}g{n_gen}", timing)
            metric = self._filter_metric(batch)
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
        out = concat_rollouts(kept, self.rollout.pad_id) if kept else batch
        usable = n_prompts - n_prompts % self.par.dp  # whole groups split evenly over the data-parallel ranks
        if not kept or usable == 0:  # every group was uniform up to the cap: train on the last batch (advantages 0)
            out, n_prompts = batch, want
        elif usable < n_prompts:
            out, n_prompts = out.select([r for g in group_rows(out.meta["uid"])[:usable] for r in g]), usable
        return out, {"batch/num_gen_batches": n_gen, "batch/kept_prompts": n_prompts}

    def _filter_metric(self, batch: Batch) -> list[float]:
        """Each response's value for DAPO's group filter (algorithm.filter_groups.metric), as verl defines them:
        `acc` / `score`: the reward extras (the scorer's own, before overlong shaping); `seq_reward`: the sum of the
        token-level scores (overlong shaping included); `seq_final_reward`: the sum of the token-level rewards, the
        scores minus the KL penalty when `use_kl_in_reward` (at the current beta; the controller steps in learn())."""
        metric = self.cfg.algorithm.filter_groups.metric
        if metric in ("acc", "score"):
            return batch.meta[f"reward:{metric}"]
        rewards = batch["token_level_scores"]
        if metric == "seq_final_reward" and self.cfg.algorithm.use_kl_in_reward:
            if self.cfg.algorithm.rollout_correction.bypass_mode:
                old = batch["rollout_log_probs"]
            else:
                r = self.cfg.actor_rollout_ref.rollout
                old, _ = self.actor.compute_log_prob(
                    batch, micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
                    max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None)
            kl = kl_penalty(old, self.reference.compute_log_prob(batch), self.cfg.algorithm.kl_penalty)
            rewards = rewards - self.kl_ctrl.value * kl * batch["response_mask"]
        return rewards.sum(-1).tolist()

    def train_step(self) -> dict[str, float]:
        timing = {}
        t_step = time.perf_counter()
        batch, metrics = self._rollout(timing)
        metrics |= self.learn(batch, timing)
        timing["step"] = time.perf_counter() - t_step
        metrics |= {f"timing_s/{k}": v for k, v in timing.items()}
        metrics["perf/throughput"] = int(batch["attention_mask"].sum()) / timing["step"] / self.par.world  # per device
        if self.cfg.trainer.rollout_data_dir:
            self._dump(Path(self.cfg.trainer.rollout_data_dir) / f"{self.global_step}.jsonl", batch)
        return metrics

    def learn(self, batch: Batch, timing: dict | None = None) -> dict[str, float]:
        """Everything after the scored rollouts: old / reference log-probs, values, advantages, the critic and
        actor updates, and the batch's metrics. `batch` is the whole step's batch (the same on every rank)."""
        cfg, metrics = self.cfg, {}
        timing = {} if timing is None else timing
        if self.needs_old_log_prob:
            with _timer(timing, "old_log_prob"):
                r = cfg.actor_rollout_ref.rollout
                batch["old_log_probs"], sum_pi_squared = self.actor.compute_log_prob(
                    batch, micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
                    max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                    sum_pi_squared=self.info.needs_sum_pi_squared)
                if sum_pi_squared is not None:
                    batch["sum_pi_squared"] = sum_pi_squared
        metrics |= self._rollout_correction(batch)
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
            alg = cfg.algorithm
            batch["advantages"], batch["returns"] = compute_advantage(
                alg.adv_estimator, token_level_rewards=batch["token_level_rewards"],
                response_mask=batch["response_mask"].float(), index=batch.meta["uid"], values=batch.get("values"),
                reward_baselines=batch.get("reward_baselines"), gamma=alg.gamma, lam=alg.lam,
                norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, old_log_probs=batch.get("old_log_probs"),
                sum_pi_squared=batch.get("sum_pi_squared"), rollout_is_weights=batch.get("rollout_is_weights"),
                reward_components=self._reward_components(batch), reward_weights=alg.gdpo_reward_weights)
        if self.critic is not None:
            with _timer(timing, "update_critic"):
                metrics |= self.critic.update(batch)
        if self.global_step > cfg.trainer.critic_warmup:
            with _timer(timing, "update_actor"):
                metrics |= self.actor.update(batch)
        metrics |= data_metrics(batch, self.max_new)
        for key, values in batch.meta.items():
            if not key.startswith("reward:") or key in ("reward:score", "reward:response_text"):
                continue
            name = key.split(":", 1)[1]
            if name in ("errors", "timeouts"):
                metrics[f"reward/{name}"] = sum(values)
            elif (present := [v for v in values if v is not None]) and all(isinstance(v, (int, float))
                                                                             for v in present):  # bools count too
                metrics[f"reward/{name}/mean"] = sum(present) / len(present)  # over the rows that returned the key
        return metrics

    def _rollout_correction(self, batch: Batch) -> dict[str, float]:
        """Bypass mode: the rollout's log-probs become the old policy's. Otherwise the gap between the rollout's
        and the trainer's probabilities as metrics, and with `rollout_is`, truncated IS weights pi_old / pi_rollout
        that the policy loss multiplies in."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]
            return {}
        if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
            return {}
        metrics = rollout_probs_diff(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
        if rc.rollout_is is None:
            return metrics
        batch["rollout_is_weights"], is_metrics = rollout_is_weights(
            batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"].float(), level=rc.rollout_is,
            threshold=rc.rollout_is_threshold, batch_normalize=rc.rollout_is_batch_normalize)
        return metrics | is_metrics

    def _reward_components(self, batch: Batch) -> torch.Tensor | None:
        """(B, K) reward components for gdpo, from the keys the reward function returned (algorithm.gdpo_reward_keys);
        a row whose scorer returned no such key (another data source's scorer, or a failed one) counts 0."""
        if not self.info.needs_reward_components:
            return None
        keys = self.cfg.algorithm.gdpo_reward_keys
        have = sorted(k.split(":", 1)[1] for k in batch.meta if k.startswith("reward:"))
        missing = [k for k in keys if f"reward:{k}" not in batch.meta]
        if missing:
            raise ConfigError(f"algorithm.gdpo_reward_keys {missing}: the reward function returned no such key "
                              f"(it returned {have}); return a dict with these keys from compute_score")
        return torch.tensor([[0.0 if v is None else v for v in batch.meta[f"reward:{k}"]] for k in keys],
                            dtype=torch.float32).T

    # ------------------------------------------------------------------ validation

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Generate for the validation prompts (each rank its share of each chunk), score, gather, and report
        mean@n / maj@n / pass@k per data source."""
        if self.val_data is None or not self._rule_scoring:
            return {}
        chunk = self.cfg.data.val_batch_size or len(self.val_data)
        records = []  # (data_source, uid, score, answer, sample) for every response, gathered over ranks
        with self.actor.generation():
            for start in range(0, len(self.val_data), chunk):
                items = [self.val_data[i] for i in range(start, min(start + chunk, len(self.val_data)))]
                share = self.par.my_slice(len(items))
                mine = []
                if share.stop > share.start:
                    self._seed(self.cfg.trainer.seed + 17 * start)
                    batch = self.rollout.generate(_to_batch(items[share], self.rollout.pad_id, f"v{start}", share.start,
                                                            vision=self.vision),
                                                  self.val_sampling)
                    _, extras = self.rule_reward(batch)
                    m = batch.meta
                    mine = [(ds, uid, s, _answer(ds, t), {"data_source": ds, "ground_truth": str(gt), "response": t,
                                                          "score": s})
                            for ds, uid, gt, t, s in zip(m["data_source"], m["uid"], m["ground_truth"],
                                                         extras["response_text"], extras["score"])]
                records += [r for part in self.par.gather(mine) for r in part]
        out = validation_metrics([r[0] for r in records], [r[1] for r in records], [r[2] for r in records],
                                 [r[3] for r in records])
        samples = [r[4] for r in records]
        tr = self.cfg.trainer
        if self.par.is_main and tr.log_val_generations:
            for s in samples[: tr.log_val_generations]:
                print(f"[val] score={s['score']:.2f} truth={s['ground_truth']!r} response={s['response'][:200]!r}")
        if self.par.is_main and tr.validation_data_dir:
            path = Path(tr.validation_data_dir) / f"{self.global_step}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))
        return out

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        tr = self.cfg.trainer
        # from here on a signal stops the run after a step, with a checkpoint (in a multi-process job, from __init__ on)
        stop, self.stop = self.stop or StopOnSignal().__enter__(), None
        try:
            self._maybe_resume()
        except BaseException:
            stop.__exit__()
            raise
        tracker = (Tracker(tr.logger, self.run_dir, self.total_steps, project=tr.project_name,
                           name=tr.experiment_name, config=to_dict(self.cfg), resumed_step=self.global_step)
                   if self.par.is_main else NullTracker())
        last_val: dict[str, float] = {}
        try:
            self.rule_reward.start()  # scorer workers start up while the first batch generates
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
                saved = tr.save_freq > 0 and (self.global_step % tr.save_freq == 0 or done)
                if saved:
                    path = self.save()
                signum = stop.agreed(self.par.distributed)
                if signum:  # preemption: the step is done; keep it and stop
                    self.preempted = (signum, path if saved else self.save())
                    break
        finally:
            stop.__exit__()
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

    def save(self) -> Path:
        tr = self.cfg.trainer
        return save_checkpoint(self.run_dir, self.global_step, self.roles, self.par, tokenizer=self.tokenizer,
                               extra={"kl_ctrl": self.kl_ctrl.state_dict(), "data_cursor": self.data_cursor},
                               contents=self.cfg.actor_rollout_ref.actor.checkpoint.save_contents,
                               keep=min((k for k in (tr.max_actor_ckpt_to_keep, tr.max_critic_ckpt_to_keep) if k),
                                        default=None))

    def _maybe_resume(self) -> None:
        tr = self.cfg.trainer
        if tr.resume_mode == "disable":
            return
        candidates = ([Path(tr.resume_from_path)] if tr.resume_mode == "resume_path"
                      else complete_checkpoints(self.run_dir))
        if not candidates:
            return
        ck = self.cfg.actor_rollout_ref.actor.checkpoint
        say = (lambda m: print(m, file=sys.stderr)) if self.par.is_main else (lambda _: None)
        path, extra = load_latest(candidates, self.roles, contents=ck.load_contents or ck.save_contents, say=say)
        self.global_step = int(extra.get("step", int(path.name.rsplit("_", 1)[1])))
        self.data_cursor = int(extra.get("data_cursor", self.global_step))
        if "kl_ctrl" in extra:
            self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        if self.par.is_main:
            print(f"resumed from {path} at step {self.global_step}")

    def _dump(self, path: Path, batch: Batch) -> None:
        if not self.par.is_main:
            return
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
    """Train; raises Preempted (after a clean shutdown) when a signal stopped the run at a step boundary."""
    trainer = RLTrainer(cfg)
    result = trainer.fit()
    shutdown()  # after an error there is no clean shutdown: the launcher stops every rank
    finish_exports()  # rank 0's hf_model exports, after the last collective: no rank waits for them
    if trainer.preempted:
        signum, path = trainer.preempted
        raise Preempted(resume_message(signum, trainer.global_step, path), signum)
    return result
