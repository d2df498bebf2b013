"""From a config to this rank's roles: which process layout, which dtypes, where each model lives."""

from __future__ import annotations

import torch

from ..algo import estimator_info
from ..models.hub import resolve_model_source
from ..models.load import LoraSettings, compute_dtype, load_causal_lm, model_config
from ..models.moe import reject_tensor_parallel
from ..models.policy import PolicyModel, ValueModel
from ..models.vision import freeze_vision_tower
from ..parallel import Parallel, ShardSettings, init_parallel, prepare_model
from ..roles.actor import Actor
from ..roles.common import Worker
from ..roles.critic import Critic
from ..roles.judge import Judge
from ..roles.reference import Reference
from ..roles.reward_model import RewardModel
from ..rollout.registry import build_engine

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def needs_critic(cfg) -> bool:
    return estimator_info(cfg.algorithm.adv_estimator).needs_critic or bool(cfg.critic.enable)


def model_sources(cfg) -> dict[str, str]:
    """Each model or tokenizer path this run loads, by config key, as a local directory: hub ids are fetched here,
    on every rank before any model loads (rank 0 downloads, the others then read the cache), and the loaders find
    them again in resolve_model_source's per-process memo."""
    model = cfg.actor_rollout_ref.model
    keys = {"actor_rollout_ref.model.path": model.path}
    if model.tokenizer_path:
        keys["actor_rollout_ref.model.tokenizer_path"] = model.tokenizer_path
    if needs_critic(cfg) and cfg.critic.model.path:
        keys["critic.model.path"] = cfg.critic.model.path
    rm = cfg.reward_model
    if rm.enable:
        keys["reward_model.model.path"] = rm.model.path
        if rm.model.input_tokenizer:
            keys["reward_model.model.input_tokenizer"] = rm.model.input_tokenizer
    return {key: resolve_model_source(path, key=key) for key, path in keys.items()}


def parallel_for(cfg) -> Parallel:
    """This process's layout: torchrun's world (or one process), the actor's fsdp_size and tp_size. One process
    still shards (FSDP2 over itself) when a trained model is to be offloaded to CPU memory."""
    actor_fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    offload = actor_fsdp.param_offload or (needs_critic(cfg) and cfg.critic.model.fsdp_config.param_offload)
    return init_parallel(device_name=cfg.trainer.device, fsdp_size=actor_fsdp.fsdp_size, tp=actor_fsdp.tp_size,
                         need_sharding=offload)


def shard_settings(fsdp_cfg, compute: torch.dtype) -> ShardSettings:
    mp = fsdp_cfg.mixed_precision
    param = DTYPES[mp.param_dtype] if mp.param_dtype else compute
    return ShardSettings(param_dtype=param, reduce_dtype=DTYPES[mp.reduce_dtype], offload=fsdp_cfg.param_offload,
                         reshard_after_forward=fsdp_cfg.reshard_after_forward)


def _moves_adam(fsdp_cfg) -> bool:
    """optimizer_offload alone: Adam's state goes to CPU memory between steps. With param_offload it lives there
    already (FSDP2 steps the optimizer on the CPU)."""
    return fsdp_cfg.optimizer_offload and not fsdp_cfg.param_offload


class Roles:
    """The models of one run on this rank: actor (+ rollout over the same weights), reference, critic, reward
    model or judge."""

    def __init__(self, cfg, par: Parallel, tokenizer, total_steps: int):
        arr, tr = cfg.actor_rollout_ref, cfg.trainer
        self.dtype = compute_dtype(arr.model.dtype, par.device)
        temperature = arr.rollout.temperature if arr.rollout.temperature > 0 else 1.0
        model_cfg = arr.model
        reject_tensor_parallel(model_config(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code,
                                            key="actor_rollout_ref.model.path"),
                               arr.actor.fsdp_config.tp_size, "actor_rollout_ref.actor.fsdp_config.tp_size")
        lora = (LoraSettings(model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules)
                if model_cfg.lora_rank > 0 else None)

        def policy(fsdp_cfg, *, trainable: bool, with_lora):
            def build(meta: bool):
                torch.manual_seed(tr.seed)  # LoRA's random init is the same at any world size (rank 0 builds it)
                model = PolicyModel(load_causal_lm(
                    model_cfg.path, meta=meta, dtype=DTYPES[fsdp_cfg.model_dtype],
                    trust_remote_code=model_cfg.trust_remote_code, override_config=model_cfg.override_config,
                    gradient_checkpointing=trainable and model_cfg.enable_gradient_checkpointing,
                    lora=with_lora, key="actor_rollout_ref.model.path"))
                if trainable and arr.actor.freeze_vision_tower:
                    freeze_vision_tower(model)
                return model

            model = prepare_model(build, par, shard_settings(fsdp_cfg, self.dtype))
            return Worker(model, par, dtype=self.dtype, balance_batch=tr.balance_batch)

        a = arr.actor
        actor_worker = policy(a.fsdp_config, trainable=True, with_lora=lora)
        self.actor = Actor(actor_worker, a, temperature=temperature, max_response_length=cfg.data.max_response_length,
                           total_steps=total_steps, seed=tr.seed, offload_optimizer=_moves_adam(a.fsdp_config),
                           max_nonfinite_in_a_row=tr.max_nonfinite_updates_in_a_row)
        self.reference = None
        if a.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            ref_worker = actor_worker if lora else policy(arr.ref.fsdp_config, trainable=False, with_lora=None)
            self.reference = Reference(ref_worker, arr.ref, temperature=temperature, adapter_off=lora is not None)
        self.critic = None
        if needs_critic(cfg):
            c, cm = cfg.critic, cfg.critic.model

            def build_value(meta: bool):
                torch.manual_seed(tr.seed + 1)
                return ValueModel.from_pretrained(cm.path or model_cfg.path, meta=meta,
                                                  dtype=DTYPES[cm.fsdp_config.model_dtype],
                                                  trust_remote_code=cm.trust_remote_code,
                                                  override_config=cm.override_config,
                                                  gradient_checkpointing=cm.enable_gradient_checkpointing,
                                                  key="critic.model.path" if cm.path else "actor_rollout_ref.model.path")

            value = prepare_model(build_value, par, shard_settings(cm.fsdp_config, self.dtype))
            self.critic = Critic(Worker(value, par, dtype=self.dtype, balance_batch=tr.balance_batch), c, a,
                                 max_response_length=cfg.data.max_response_length, total_steps=total_steps,
                                 seed=tr.seed, offload_optimizer=_moves_adam(cm.fsdp_config),
                                 max_nonfinite_in_a_row=tr.max_nonfinite_updates_in_a_row)
        rm = cfg.reward_model
        self.reward_model = (RewardModel.from_config(cfg, par, tokenizer, balance_batch=tr.balance_batch)
                             if rm.enable and not rm.judge.enable else None)
        self.judge = Judge.from_config(cfg, par) if rm.enable and rm.judge.enable else None
        r = arr.rollout
        self.rollout = build_engine(r.name, actor_worker.model, tokenizer, device=par.device,
                                    dtype=compute_dtype(r.dtype, par.device), micro_batch_size=r.micro_batch_size,
                                    enforce_eager=r.enforce_eager)

    @property
    def trained(self) -> dict:
        """What a checkpoint holds: the roles with weights and an optimizer."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
