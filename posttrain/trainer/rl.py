"""RLTrainer.fit(): generate -> reward -> log-probs -> advantages -> update -> metrics, one readable loop. What it
runs on (data, reward, roles, engine, sampling settings) is built by setup.build_rl_parts."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..agents.episode_log import episodes_file, write_episodes
from ..agents.metrics import episode_metrics
from ..agents.rollout import require_samples, run_episodes
from ..algo import compute_advantage
from ..algo.kl import apply_kl_in_reward, kl_penalty
from ..algo.rollout_correction import rollout_is_weights, rollout_probs_diff, rollout_rejection_mask
from ..algo.staleness import staleness_metrics
from ..config import ConfigError, to_dict
from ..data.batch import Batch
from ..data.dataset import collate_prompts
from ..models.vision import MM_KEY
from ..parallel import Parallel, shutdown
from ..parallel.samples import first_sample_rows, prompt_rows
from ..reward.checks import check_error_rate
from ..reward.registry import extract_answer_for
from ..roles.common import group_rows
from ..rollout.base import SamplingParams, concat_rollouts
from ..rollout.routing import generate_recording_routing
from ..watch import ACTIONS, Watch, WatchStopped
from .checkpoint import complete_checkpoints, finish_exports, save_checkpoint
from .preempt import Preempted, StopOnSignal, resume_message
from .recovery import load_latest
from .metrics import data_metrics, reward_metrics, timer, validation_metrics
from .setup import build_rl_parts, parallel_for, preflight
from .tracking import NullTracker, Tracker

def _to_batch(items, pad_id: int, uid_prefix: str, first_index: int = 0, *, vision: bool = False,
              indices: list[int] | None = None) -> Batch:
    """The prompts of `items` as a batch, uids numbered from `first_index` (or by `indices`, one per item);
    `vision`: each row's image inputs travel in meta[MM_KEY]."""
    prompts, prompt_mask = collate_prompts(items, pad_id)
    indices = indices if indices is not None else range(first_index, first_index + len(items))
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask},
                 {"uid": [f"{uid_prefix}-{i}" for i in indices],
                  "data_source": [it.data_source for it in items], "ground_truth": [it.ground_truth for it in items],
                  "extra_info": [it.extra_info for it in items], "raw_prompt": [it.raw_prompt for it in items],
                  "agent_name": [getattr(it, "agent_name", None) for it in items],
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
        # loop while rank 1 is between build_rl_parts' barrier and fit()) would die of the signal's default action;
        # the ranks that noted it then fail in the step's first collective and nothing is saved. A signal noted during
        # setup stops the run after its first step. One process has no peer to lose: it keeps the default until fit().
        self.stop = StopOnSignal().__enter__() if self.par.distributed and self.par.world > 1 else None
        try:
            self.parts = build_rl_parts(cfg, self.par)  # data, reward, roles, sampling; rank 0 writes the run folder
        except BaseException:
            if self.stop is not None:
                self.stop.__exit__()
            raise
        self.global_step = 0
        self.preempted: tuple[int, Path] | None = None  # (signal, checkpoint) when a signal stopped the run
        self.data_cursor = 0  # batches of prompts drawn so far (dynamic sampling draws more than one per step)
        self.watch = Watch.from_config(cfg, self.parts.run_dir, max_length=self.parts.max_new, writer=self.par.is_main)
        self.watch_stop: str | None = None  # why the watch stopped the run (trainer.watch: a detector's `stop`)
        self.resumed_from: Path | None = None  # the checkpoint this run resumed from

    def _seed(self, base: int) -> None:
        """Sampling noise: the same for the ranks of one tensor-parallel group, different across data ranks."""
        torch.manual_seed((base + 104_729 * self.par.dp_rank) % 2**63)

    # ------------------------------------------------------------------ the step

    def _generate_scored(self, items, uid_prefix: str, timing: dict) -> Batch:
        """Sample `n` responses for this rank's share of `items`, add the ReMax greedy baseline if needed, score
        them, and gather every rank's scored rollouts: the result is the whole batch, the same on every rank. The
        reward extras travel in `meta` under `reward:<name>` so they follow any later row selection."""
        parts, engine = self.parts, self.parts.engine
        n, greedy_extras = parts.sampling.n, None
        runs = self.par.my_samples(len(items), n)  # (prompt, first sample, samples): see Parallel.my_samples
        rows, per_row = prompt_rows(runs, n)
        batch = _to_batch([items[p] for p in rows], engine.pad_id, uid_prefix, vision=parts.vision, indices=rows)
        with timer(timing, "gen"), parts.actor.generation():
            batch = self._rollout(batch, replace(parts.sampling, n=per_row),
                                  record_routing=self.cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay)
            if parts.info.needs_greedy_baseline:
                greedy = self._rollout(_to_batch([items[p] for p, _, _ in runs], engine.pad_id, "greedy",
                                                 vision=parts.vision),
                                       SamplingParams(n=1, do_sample=False, max_new_tokens=parts.max_new,
                                                      ignore_eos=parts.sampling.ignore_eos))
                baseline, greedy_extras = parts.reward(greedy)
                batch["reward_baselines"] = baseline.sum(-1).repeat_interleave(torch.tensor([c for *_, c in runs]))
        with timer(timing, "reward"):
            batch["token_level_scores"], extras = parts.reward(batch)
        if greedy_extras is not None:  # a greedy response that failed to score counts on its prompt's first row
            for key in ("errors", "timeouts"):
                for row, failed in first_sample_rows(runs, greedy_extras[key]):
                    extras[key][row] += failed
        batch.meta.update({f"reward:{k}": v for k, v in extras.items()})
        out = require_samples(concat_rollouts(self.par.gather(batch), engine.pad_id), len(items))
        check_error_rate(out.meta.get("reward:errors", []), out.meta.get("reward:timeouts", []),
                         self.cfg.reward_model.max_error_rate,
                         responses=len(out) + (len(out) // n if greedy_extras is not None else 0))
        return out

    def _rollout(self, batch: Batch, sampling: SamplingParams, *, record_routing: bool = False) -> Batch:
        """Responses for `batch`'s prompts: one generated response each, or with `rollout.multi_turn.enable` one
        finished episode each (agents/rollout.py: `response_mask` 1 on policy tokens only). `record_routing`: each
        row's experts as the engine routed them (router replay R3, rollout/routing.py)."""
        if self.parts.episodes is None:
            if record_routing:
                return generate_recording_routing(self.parts.engine, batch, sampling)
            return self.parts.engine.generate(batch, sampling)
        return run_episodes(self.parts.episodes, batch, sampling)

    def _program_counts(self) -> dict[str, float]:
        """Agent programs' counts since the last call (runs, failures by kind, runs without a call, samples),
        summed over the ranks; {} without agent programs. Every rank calls it at the same points."""
        take = getattr(self.parts.episodes, "take_metrics", None)
        if take is None:
            return {}
        total: dict[str, float] = {}
        for counts in self.par.gather(take()):
            for key, value in counts.items():
                total[key] = total.get(key, 0.0) + value
        return total

    def _training_batch(self, timing: dict) -> tuple[Batch, dict]:
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
        out = concat_rollouts(kept, self.parts.engine.pad_id) if kept else batch
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
                old, _ = self.parts.actor.compute_log_prob(
                    batch, micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
                    max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None)
            kl = kl_penalty(old, self.parts.reference.compute_log_prob(batch), self.cfg.algorithm.kl_penalty)
            rewards = rewards - self.parts.kl_ctrl.value * kl * batch["response_mask"]
        return rewards.sum(-1).tolist()

    def train_step(self) -> dict[str, float]:
        timing = {}
        t_step = time.perf_counter()
        cursor = self.data_cursor  # before this step's batch: where a checkpoint of the step before resumes
        batch, metrics = self._training_batch(timing)
        if "episode" in batch.meta:
            metrics |= episode_metrics(batch.meta["episode"])
        metrics |= self._program_counts()
        metrics |= self._watch("batch", batch, self.global_step, before=(self.global_step - 1, cursor))
        if not self.watch_stop:  # a watch that stops the run leaves the flagged batch untrained
            metrics |= self.learn(batch, timing, trainer_version=self.global_step - 1)  # the weights it trains
            metrics |= self._watch("update", batch, self.global_step, metrics)
            self.parts.order.update(batch)  # a curriculum sampler sees the trained batch before the next draw
        timing["step"] = time.perf_counter() - t_step
        metrics |= {f"timing_s/{k}": v for k, v in timing.items()}
        metrics["perf/throughput"] = int(batch["attention_mask"].sum()) / timing["step"] / self.par.world  # per device
        if self.cfg.trainer.rollout_data_dir:
            self._dump(Path(self.cfg.trainer.rollout_data_dir) / f"{self.global_step}.jsonl", batch)
        return metrics

    def learn(self, batch: Batch, timing: dict | None = None, *, trainer_version: int | None = None
              ) -> dict[str, float]:
        """Everything after the scored rollouts: old / reference / teacher log-probs, values, advantages, the critic
        and actor updates, and the batch's metrics. `batch` is the whole step's batch (the same on every rank). A
        batch with `rollout_versions` (asynchronous runs) adds staleness metrics against `trainer_version`."""
        cfg, parts, metrics = self.cfg, self.parts, {}
        if "rollout_versions" in batch:
            if trainer_version is None:
                raise ValueError("a batch with rollout_versions needs learn(..., trainer_version=...) for staleness")
            metrics |= staleness_metrics(batch["rollout_versions"], batch["response_mask"], trainer_version)
        timing = {} if timing is None else timing
        if parts.needs_old_log_prob:
            with timer(timing, "old_log_prob"):
                r = cfg.actor_rollout_ref.rollout
                batch["old_log_probs"], sum_pi_squared = parts.actor.compute_log_prob(
                    batch, micro_batch_size=r.log_prob_micro_batch_size_per_gpu,
                    max_tokens=r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None,
                    sum_pi_squared=parts.info.needs_sum_pi_squared)
                if sum_pi_squared is not None:
                    batch["sum_pi_squared"] = sum_pi_squared
        metrics |= self._rollout_correction(batch)
        if parts.reference is not None:
            with timer(timing, "ref"):
                batch["ref_log_probs"] = parts.reference.compute_log_prob(batch)
        if parts.teachers is not None:
            with timer(timing, "teacher"):
                for key, value in parts.teachers.score(batch).items():
                    batch[key] = value
        if parts.critic is not None:
            with timer(timing, "values"):
                batch["values"] = parts.critic.compute_values(batch)
        with timer(timing, "adv"):
            if cfg.algorithm.use_kl_in_reward:
                batch["token_level_rewards"], kl_metrics = apply_kl_in_reward(
                    batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_probs"], batch["response_mask"],
                    parts.kl_ctrl, cfg.algorithm.kl_penalty)
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
        if parts.critic is not None:
            with timer(timing, "update_critic"):
                metrics |= parts.critic.update(batch)
        if self.global_step > cfg.trainer.critic_warmup:
            with timer(timing, "update_actor"):
                metrics |= parts.actor.update(batch)
        return metrics | data_metrics(batch, parts.max_new) | reward_metrics(batch.meta)

    def _rollout_correction(self, batch: Batch) -> dict[str, float]:
        """Bypass mode: the rollout's log-probs become the old policy's. Otherwise the gap between the rollout's
        and the trainer's probabilities as metrics, with `rollout_is` truncated IS weights pi_old / pi_rollout
        that the policy loss multiplies in, and with `rollout_rs` (or the token veto) the rejected tokens taken out of
        the response mask."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.bypass_mode:
            batch["old_log_probs"] = batch["rollout_log_probs"]
            return {}
        if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
            return {}
        metrics = rollout_probs_diff(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"])
        if rc.rollout_is is not None:
            batch["rollout_is_weights"], is_metrics = rollout_is_weights(
                batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"].float(),
                level=rc.rollout_is, threshold=rc.rollout_is_threshold, batch_normalize=rc.rollout_is_batch_normalize,
                mode=rc.rollout_is_mode)
            metrics |= is_metrics
        if rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None:
            # as verl: the rejected tokens (and vetoed responses) leave the response mask; forwards still see them
            keep, rs_metrics = rollout_rejection_mask(batch["old_log_probs"], batch["rollout_log_probs"],
                                                      batch["response_mask"], options=rc.rollout_rs,
                                                      threshold=rc.rollout_rs_threshold,
                                                      veto=rc.rollout_token_veto_threshold)
            if "response_attention_mask" not in batch:
                batch["response_attention_mask"] = batch["response_mask"]
            batch["response_mask"] = keep.to(batch["response_mask"].dtype)
            metrics |= rs_metrics
        return metrics

    def _reward_components(self, batch: Batch) -> torch.Tensor | None:
        """(B, K) reward components for gdpo, from the keys the reward function returned (algorithm.gdpo_reward_keys);
        a row whose scorer returned no such key (another data source's scorer, or a failed one) counts 0."""
        if not self.parts.info.needs_reward_components:
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
        if self.parts.val_data is None or not self.parts.rule_scoring:
            return {}
        chunk = self.cfg.data.val_batch_size or len(self.parts.val_data)
        records = []  # (data_source, uid, score, answer, sample) for every response, gathered over ranks
        with self.parts.actor.generation():
            for start in range(0, len(self.parts.val_data), chunk):
                items = [self.parts.val_data[i] for i in range(start, min(start + chunk, len(self.parts.val_data)))]
                share = self.par.my_slice(len(items))
                mine = []
                if share.stop == share.start:
                    self.parts.engine.ready()  # a sharded policy's one-time decoding check is agreed by every rank
                else:
                    self._seed(self.cfg.trainer.seed + 17 * start)
                    prompts = _to_batch(items[share], self.parts.engine.pad_id, f"v{start}", share.start,
                                        vision=self.parts.vision)
                    batch = self._rollout(prompts, self.parts.val_sampling)
                    _, extras = self.parts.rule_reward(batch)
                    m = batch.meta
                    episodes = m.get("episode") or [None] * len(batch)
                    mine = [(ds, uid, s, _answer(ds, t), {"data_source": ds, "ground_truth": str(gt), "response": t,
                                                          "score": s}, ep)
                            for ds, uid, gt, t, s, ep in zip(m["data_source"], m["uid"], m["ground_truth"],
                                                             extras["response_text"], extras["score"], episodes)]
                records += [r for part in self.par.gather(mine) for r in part]
        out = validation_metrics([r[0] for r in records], [r[1] for r in records], [r[2] for r in records],
                                 [r[3] for r in records])
        samples = [r[4] for r in records]
        tr = self.cfg.trainer
        if self.par.is_main and tr.log_val_generations:
            for s in samples[: tr.log_val_generations]:
                print(f"[val] score={s['score']:.2f} truth={s['ground_truth']!r} response={s['response'][:200]!r}")
        episodes = [(r[5], r[2]) for r in records if r[5] is not None]
        out |= {f"val-{k}": v for k, v in self._program_counts().items()}
        if episodes:
            out |= {f"val-{k}": v for k, v in episode_metrics([e for e, _ in episodes]).items()}
            if self.par.is_main:  # the validation episodes, readable with `posttrain episodes RUN_DIR`
                write_episodes(episodes_file(self.parts.run_dir, self.global_step), [e for e, _ in episodes],
                               [s for _, s in episodes], self.parts.tokenizer)
        if self.par.is_main and tr.validation_data_dir:
            path = Path(tr.validation_data_dir) / f"{self.global_step}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))
        return out

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        tr, parts = self.cfg.trainer, self.parts
        # from here on a signal stops the run after a step, with a checkpoint (in a multi-process job, from __init__ on)
        stop, self.stop = self.stop or StopOnSignal().__enter__(), None
        try:
            self._maybe_resume()
        except BaseException:
            stop.__exit__()
            raise
        tracker = (Tracker(tr.logger, parts.run_dir, parts.total_steps, project=tr.project_name,
                           name=tr.experiment_name, config=to_dict(self.cfg), resumed_step=self.global_step)
                   if self.par.is_main else NullTracker())
        last_val: dict[str, float] = {}
        if self.watch is not None:
            # a resumed run's history (from the run that wrote the checkpoint), RUN_DIR/watch/ (rank 0)
            self.watch.start(self.global_step, self.resumed_from)
        try:
            parts.rule_reward.start()  # scorer workers start up while the first batch generates
            if tr.val_only:  # evaluate the starting point (a resumed checkpoint too) and stop: nothing trains
                last_val = self.validate()
                tracker.log(last_val, self.global_step)
                return last_val
            if tr.val_before_train and parts.val_data is not None and self.global_step == 0:
                last_val = self.validate()
                tracker.log(last_val, self.global_step)
                self._watched(last_val)
            while self.global_step < parts.total_steps:
                self.global_step += 1
                metrics = self.train_step()
                done = self.global_step == parts.total_steps
                if not self.watch_stop and parts.val_data is not None and tr.test_freq > 0 and (
                        self.global_step % tr.test_freq == 0 or done):
                    last_val = self.validate()
                    metrics |= last_val
                    metrics |= self._watch("validation", self.global_step, metrics)
                tracker.log(metrics, self.global_step)
                tracker.advance(self.global_step)
                self._watched(metrics)
                if self.watch_stop:  # its checkpoint is saved
                    break
                saved = tr.save_freq > 0 and (self.global_step % tr.save_freq == 0 or done)
                if saved:
                    path = self.save()
                signum = stop.agreed(self.par)
                if signum:  # preemption: the step is done; keep it and stop
                    self.preempted = (signum, path if saved else self.save())
                    break
        finally:
            stop.__exit__()
            tracker.close()
            parts.reward.close()
        return last_val

    def _watch(self, phase: str, *args, before: tuple[int, int] | None = None) -> dict[str, float]:
        """The watch's `phase` on this step (watch/watcher.py): its `watch/*` metrics. The strongest action of what
        fired, agreed over the ranks, acts: `checkpoint` and `stop` save the weights the phase judged (the batch
        phase's are those before the update: step N-1 with the data cursor before the batch, `before`); `stop` then
        ends the run after this step (`watch_stop`)."""
        if self.watch is None:
            return {}
        metrics, findings = getattr(self.watch, phase)(*args)
        level = self.par.max(max((ACTIONS.index(f.action) + 1 for f in findings), default=0), all_ranks=True)
        if level >= ACTIONS.index("checkpoint") + 1:
            step, cursor = before or (self.global_step, self.data_cursor)
            path = self.parts.run_dir / f"global_step_{step}"
            if not path.is_dir():
                path = self.save(step, cursor)
            if self.par.is_main:
                print(f"[watch] checkpoint of step {step}: {path}", file=sys.stderr, flush=True)
            if level == ACTIONS.index("stop") + 1:
                what = "; ".join(f"{f.detector} fired ({f.note})" for f in findings) or "a detector fired"
                self.watch_stop = (f"the watch stopped the run at step {self.global_step}: {what}. The checkpoint "
                                   f"{path} holds the weights {'before the flagged batch' if before else 'it judged'}"
                                   f"; flagged samples: {self.watch.folder / 'findings.jsonl'}")
        return metrics

    def _watched(self, metrics: dict[str, float]) -> None:
        """The step's logged metrics join the watch's history."""
        if self.watch is not None:
            self.watch.record(self.global_step, metrics)

    def _next_items(self):
        """The next batch of prompts (data/sampler.py: the order depends only on data.seed, the epoch and a sampler
        class's updates, so a resume replays it)."""
        indices = self.parts.order.batch(self.data_cursor)
        self.data_cursor += 1
        return [self.parts.train_data[i] for i in indices]

    def save(self, step: int | None = None, data_cursor: int | None = None) -> Path:
        """A checkpoint of the weights as they are, as step `step` (default: this step) with `data_cursor`."""
        tr, parts = self.cfg.trainer, self.parts
        step, data_cursor = (self.global_step, self.data_cursor) if step is None else (step, data_cursor)
        return save_checkpoint(parts.run_dir, step, parts.trained, self.par, tokenizer=parts.tokenizer,
                               extra={"kl_ctrl": parts.kl_ctrl.state_dict(), "data_cursor": data_cursor},
                               contents=self.cfg.actor_rollout_ref.actor.checkpoint.save_contents,
                               keep=min((k for k in (tr.max_actor_ckpt_to_keep, tr.max_critic_ckpt_to_keep) if k),
                                        default=None))

    def _maybe_resume(self) -> None:
        tr = self.cfg.trainer
        if tr.resume_mode == "disable":
            return
        candidates = ([Path(tr.resume_from_path)] if tr.resume_mode == "resume_path"
                      else complete_checkpoints(self.parts.run_dir))
        if not candidates:
            return
        ck = self.cfg.actor_rollout_ref.actor.checkpoint
        say = (lambda m: print(m, file=sys.stderr)) if self.par.is_main else (lambda _: None)
        path, extra = load_latest(candidates, self.parts.trained, contents=ck.load_contents or ck.save_contents,
                                  say=say)
        self.global_step = int(extra.get("step", int(path.name.rsplit("_", 1)[1])))
        self.resumed_from = path
        self.data_cursor = int(extra.get("data_cursor", self.global_step))
        if "kl_ctrl" in extra:
            self.parts.kl_ctrl.load_state_dict(extra["kl_ctrl"])
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


def run_rl(cfg) -> dict[str, float]:
    """Train; raises Preempted (after a clean shutdown) when a signal stopped the run at a step boundary."""
    trainer = RLTrainer(cfg)
    result = trainer.fit()
    shutdown()  # after an error there is no clean shutdown: the launcher stops every rank
    finish_exports()  # rank 0's hf_model exports, after the last collective: no rank waits for them
    if trainer.preempted:
        signum, path = trainer.preempted
        raise Preempted(resume_message(signum, trainer.global_step, path), signum)
    if trainer.watch_stop:
        raise WatchStopped(trainer.watch_stop)
    return result
