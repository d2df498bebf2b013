"""The actor: owns the policy model and its optimizer; log-probs and the PPO-style update.

The update runs the model in train mode (dropout on, if the model config has any); log-prob passes run in eval
mode. Mini-batches hold whole prompt groups (`ppo_mini_batch_size` prompts; `shuffle` permutes the groups), each
split over data-parallel ranks; the loss normaliser is the whole mini-batch's, so the summed gradient — and every
metric — is the same at any world size.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from ..algo import LossSettings, agg_loss, agg_norm, get_policy_loss, kl_penalty
from ..algo.bypass import BypassSettings, bypass_loss
from ..algo.distill import DistillSettings, combine, distillation_term, forward_kl_topk, reverse_kl_estimate
from ..algo.stats import masked_mean
from ..data.batch import Batch
from ..errors import ConfigError
from ..parallel import gathered_for_generation, set_gradient_sync
from ..models.load import eval_mode
from ..models.logprobs import SUM_PI_SQUARED
from ..models.moe import RouterRecorder, moe_spec
from ..models.router_replay import RoutingSession, routing_shape, targets_of
from ..parallel.shard import base_model
from .common import ModelRunner, group_rows, make_optimizer
from .nonfinite import NonFiniteGuard


COUNTS = ("actor/empty_mini_batches",)  # summed over the step's updates; every other metric is their mean


class Actor:
    def __init__(self, runner: ModelRunner, cfg, *, temperature: float, max_response_length: int, total_steps: int,
                 seed: int = 0, offload_optimizer: bool = False, max_nonfinite_in_a_row: int = 5,
                 distill: DistillSettings | None = None, bypass: BypassSettings | None = None):
        self.runner, self.model, self.cfg = runner, runner.model, cfg
        self.temperature = temperature
        self.norm_const = cfg.loss_scale_factor or max_response_length
        self.optimizer, self.scheduler = make_optimizer(self.model, cfg.optim, total_steps)
        self.policy_loss = get_policy_loss(cfg.policy_loss.loss_mode)
        self.loss_settings = loss_settings(cfg, self.norm_const)
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_steps = 0
        self.offload_optimizer = offload_optimizer
        self.nonfinite = NonFiniteGuard("actor", max_nonfinite_in_a_row)
        self.moe = moe_spec(base_model(self.model))  # None for a dense model
        self.distill = distill  # on-policy distillation's loss settings, or None
        # bypass mode's loss (rejection sampling, the token veto, loss_type=reinforce; algo/bypass.py), or None: as
        # verl, judged inside the loss against the current policy
        self.bypass = bypass
        # MoE router replay (models/router_replay.py): R2 records in compute_log_prob, R3 takes the rollout's record;
        # both replay in the update, R3 also in compute_log_prob
        self.replay = cfg.router_replay.mode
        self.routing = None
        if self.replay != "disabled":
            try:
                self.routing = routing_shape(self.model)
            except ValueError as e:
                raise ConfigError(f"actor_rollout_ref.actor.router_replay.mode={self.replay}: {e}") from None
        self._replay_counts = [0, 0]  # (token, layer) pairs replayed, and those the router chose otherwise
        self._replay_metrics: dict[str, float] = {}
        self.gather_for_generation = True  # the engine decodes with this model (set from the engine: RolloutEngine)

    def generation(self):
        """Around a generate call: the sharded policy gathered once (see parallel.gathered_for_generation), unless
        the engine holds weights of its own (`gather_for_generation` False: vLLM gathers them bucket by bucket)."""
        return gathered_for_generation(self.model) if self.gather_for_generation else contextlib.nullcontext()

    def counters(self) -> dict:
        """State beside weights and optimizer that a resume must restore for the run to continue exactly."""
        return {"generator": self.generator.get_state(), "skipped_steps": self.skipped_steps,
                "scheduler": self.scheduler.state_dict()}

    def load_counters(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.skipped_steps = int(state["skipped_steps"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    @torch.no_grad()
    def compute_log_prob(self, batch: Batch, micro_batch_size=None, max_tokens=None, with_entropy=False,
                         sum_pi_squared=False):
        """(B, L) log-probs (and entropy, or with `sum_pi_squared` sum_v pi_v^2) of every row of the global batch."""
        with_entropy = SUM_PI_SQUARED if sum_pi_squared else with_entropy
        record, counts = self.replay == "R2", [0, 0]

        def compute(mb):
            session = self._routing(mb, record=record)
            with session if session is not None else contextlib.nullcontext():
                logp, ent = self.runner.logprobs(mb, temperature=self.temperature, with_entropy=with_entropy,
                                                 routing=session)
            out = (logp, ent) if with_entropy else (logp,)
            if record:  # each row's record, flattened with positions outermost; +1 so that gather's padding is none
                return *out, (session.table + 1).flatten(1).to(torch.int32)
            if session is not None:
                counts[0] += session.compared
                counts[1] += session.mismatched
            return out

        with eval_mode(self.model):
            out = self.runner.per_row(batch, compute,
                                      micro_batch_size=micro_batch_size or self.cfg.ppo_micro_batch_size_per_gpu,
                                      max_tokens=max_tokens)
        if record:
            layers, k = self.routing
            table = out[-1].view(len(batch), -1, layers, k).long() - 1
            batch.meta["routed_experts"] = [table[i, :n].to(torch.int16).clone()
                                            for i, n in enumerate(batch["attention_mask"].sum(-1).tolist())]
        elif self.replay == "R3":
            compared, mismatched = self.runner.par.sum(torch.tensor(counts, dtype=torch.float64)).tolist()
            self._replay_metrics["actor/router_replay/old_log_prob_mismatch"] = mismatched / max(compared, 1.0)
        return out[0], (out[1] if with_entropy else None)

    def _routing(self, mb: Batch, *, record: bool = False) -> RoutingSession | None:
        """The routing session of one micro-batch's forward (models/router_replay.py): recording (R2's
        compute_log_prob), replaying the rows' records, or None without router replay."""
        if self.routing is None:
            return None
        if record:
            return RoutingSession(self.model, record_width=mb["input_ids"].shape[1], rows=len(mb))
        if "routed_experts" not in mb.meta:
            raise ValueError(f"router_replay.mode={self.replay}: the batch holds no routing record (R2 records it in "
                             "the old-log-prob pass, R3 in the rollout)")
        return RoutingSession(self.model, targets=targets_of(mb.meta["routed_experts"]))

    def update(self, batch: Batch) -> dict[str, float]:
        """ppo_epochs x mini-batches (one optimizer step each) x micro-batches (gradient accumulation)."""
        cfg = self.cfg
        sums: dict[str, list[float]] = defaultdict(list)
        self.model.train()
        groups = group_rows(batch.meta["uid"])
        for _ in range(cfg.ppo_epochs):
            order = (torch.randperm(len(groups), generator=self.generator).tolist() if cfg.shuffle
                     else list(range(len(groups))))
            for start in range(0, len(groups), cfg.ppo_mini_batch_size):
                rows = [r for g in order[start:start + cfg.ppo_mini_batch_size] for r in groups[g]]
                self._step(batch.select(rows), sums)
        out = {k: sum(v) if k in COUNTS else sum(v) / len(v) for k, v in sums.items() if v}
        if self.routing is not None:  # the share of replayed (token, layer) pairs the router would have sent elsewhere
            compared, mismatched = self.runner.par.sum(torch.tensor(self._replay_counts, dtype=torch.float64)).tolist()
            out["actor/router_replay/mismatch"] = mismatched / max(compared, 1.0)
            out |= self._replay_metrics
            self._replay_counts, self._replay_metrics = [0, 0], {}
        out["actor/skipped_steps"] = float(self.skipped_steps)  # the run's total so far, not a per-update value
        out["actor/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return out

    def _step(self, mini: Batch, sums) -> None:
        cfg, runner = self.cfg, self.runner
        norm = agg_norm(mini["response_mask"].float(), self.norm_const)  # the whole mini-batch's, on every rank
        all_tokens = max(float(mini["attention_mask"].sum()), 1.0)  # the router loss's normaliser (every real token)
        need_entropy = cfg.entropy_coeff != 0
        totals = defaultdict(float)
        mine = mini.select(runner.my_rows(mini))
        micros = runner.micro_batches(mine, cfg.ppo_micro_batch_size_per_gpu,
                                      max_tokens=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None)
        self.optimizer.zero_grad(set_to_none=True)
        loss_not_finite = False
        with runner.casts_kept():  # each weight cast once for all the micro-batches
            for i, mb in enumerate(micros):
                set_gradient_sync(self.model, i == len(micros) - 1)
                mask = mb["response_mask"].float().to(runner.device)
                router = RouterRecorder(self.moe) if self.moe is not None else None
                topk_ids = mb["teacher_topk_ids"] if self.distill is not None and self.distill.uses_topk else None
                routing = self._routing(mb)  # entered until after the backward pass, which recomputes layers
                if routing is not None:
                    routing.__enter__()
                out = runner.logprobs(mb, temperature=self.temperature, with_entropy=True, router=router,
                                      extra_tokens=topk_ids, routing=routing)
                logp, ent = out[0], out[1]
                old = mb["old_log_probs"].to(runner.device) if "old_log_probs" in mb else logp.detach()
                weights = mb["rollout_is_weights"].to(runner.device) if "rollout_is_weights" in mb else None
                advantages = mb["advantages"].to(runner.device)
                if self.bypass is not None:
                    pg_loss, metrics = bypass_loss(self.policy_loss, logp, old, advantages, mask, bypass=self.bypass,
                                                   settings=self.loss_settings, norm=norm,
                                                   sum_over_ranks=runner.par.sum)
                else:
                    pg_loss, metrics = self.policy_loss(logp, old, advantages, mask, settings=self.loss_settings,
                                                        norm=norm, rollout_is_weights=weights)
                loss, distill_loss = pg_loss, None
                if self.distill is not None:
                    student_topk = out[2] if topk_ids is not None else None
                    distill_loss = self._distillation(mb, logp, student_topk, old, mask, norm, weights, totals,
                                                      share=float(mask.sum()) / max(norm.tokens, 1.0))
                    loss = combine(pg_loss, distill_loss, self.distill)
                entropy = agg_loss(ent.detach() if not need_entropy else ent, mask, cfg.loss_agg_mode, norm)
                # in the order they are computed, for naming the first non-finite one
                watched = [("advantages", advantages), ("old_log_probs", old), ("rollout_is_weights", weights),
                           ("log_probs", logp)] + ([("entropy", ent)] if need_entropy else []) + [("pg_loss", pg_loss)]
                if distill_loss is not None:
                    watched.append(("distillation_loss", distill_loss))
                if need_entropy:
                    loss = loss - cfg.entropy_coeff * entropy
                if cfg.use_kl_loss:
                    ref = mb["ref_log_probs"].to(runner.device)
                    kl = agg_loss(kl_penalty(logp, ref, cfg.kl_loss_type), mask, cfg.loss_agg_mode, norm)
                    loss = loss + cfg.kl_loss_coef * kl
                    totals["actor/kl_loss"] += kl.item()
                    watched[-1:-1] = [("ref_log_probs", ref)]
                    watched.append(("kl_loss", kl))
                if router is not None:
                    loss = self._router_loss(loss, router, float(mb["attention_mask"].sum()) / all_tokens, totals,
                                             watched)
                watched = [(name, value) for name, value in watched if value is not None]
                loss_not_finite |= self.nonfinite.loss_not_finite(loss, watched, mask)
                try:
                    runner.backward(loss)
                finally:
                    if routing is not None:
                        routing.__exit__(None, None, None)
                        self._replay_counts[0] += routing.compared
                        self._replay_counts[1] += routing.mismatched
                share = float(mask.sum()) / max(norm.tokens, 1.0)  # token share: metrics averaged per token
                totals["actor/pg_loss"] += pg_loss.item()
                totals["actor/entropy"] += entropy.item()
                for k, v in metrics.items():
                    totals[k] += float(v) * share
        grad_norm, stepped = runner.clip_and_step(self.optimizer, cfg.grad_clip, self.offload_optimizer,
                                                  loss_not_finite=loss_not_finite)
        if not stepped:
            self.skipped_steps += 1
        self.nonfinite.after_update(stepped, grad_norm)
        for k, v in runner.sum_metrics(totals).items():
            sums[k].append(v)
        sums["actor/empty_mini_batches"].append(float(norm.tokens == 0))  # nothing to learn from: the loss is 0
        sums["actor/grad_norm"].append(grad_norm)


    def _distillation(self, mb, logp, student_topk, old, mask, norm, weights, totals, *, share: float):
        """One micro-batch's distillation loss against the teacher's scores in `mb` (algo/distill.py); its
        metrics go into `totals` (the loss summed like pg_loss, the rest weighted by the micro-batch's token share)."""
        s, device = self.distill, self.runner.device
        metrics = {}
        if s.uses_topk:
            per_token, student_mass, teacher_mass = forward_kl_topk(
                student_topk, mb["teacher_topk_log_probs"].to(device), s.log_prob_min_clamp)
            metrics = {"actor/distillation/student_mass": masked_mean(student_mass.detach(), mask),
                       "actor/distillation/teacher_mass": masked_mean(teacher_mass, mask)}
        else:
            per_token = reverse_kl_estimate(logp, mb["teacher_log_probs"].to(device), s.loss_mode)
        loss, term_metrics = distillation_term(per_token, logp, old, mask, settings=s, loss_settings=self.loss_settings,
                                               norm=norm, rollout_is_weights=weights)
        for key, value in (metrics | term_metrics).items():
            totals[key] += float(value) if key == "actor/distillation/loss" else float(value) * share
        return loss

    def _router_loss(self, loss, router: RouterRecorder, share: float, totals, watched):
        """A MoE model's load-balancing loss, as the model adds it in training (`output_router_logits`, times
        `router_aux_loss_coef`): computed per micro-batch over its real tokens and weighted by the micro-batch's
        share of the mini-batch's tokens, so the step's loss holds the token-weighted mean over micro-batches and
        ranks. Router metrics are logged whether the loss is on or not."""
        aux = router.aux_loss()
        for key, value in router.metrics(aux).items():
            totals[f"actor/{key}"] += value * share
        if self.moe.aux_on and self.moe.aux_coef:
            watched.append(("router_aux_loss", aux))
            return loss + self.moe.aux_coef * share * aux
        return loss


def loss_settings(cfg, norm_const: float) -> LossSettings:
    """The policy loss's constants from the actor config (clip_ratio_low / high fall back to clip_ratio)."""
    pl = cfg.policy_loss
    return LossSettings(
        loss_agg_mode=cfg.loss_agg_mode,
        clip_ratio_low=cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
        clip_ratio_high=cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
        clip_ratio_c=cfg.clip_ratio_c, const=norm_const, clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb,
        clip_cov_ub=pl.clip_cov_ub, kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef, tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg, dro_beta=pl.dro_beta)
