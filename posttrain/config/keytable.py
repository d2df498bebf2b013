"""Every config key users bring from the familiar key tree, and what posttrain does with it: one table.

Keys of posttrain's own schema (schema.py) are acted on; DESCRIPTIONS says how. Every other key of the familiar
schema (its `ppo_trainer` and `ppo_megatron_trainer` trees) matches a RULE, first match wins:
  note   accepted; the value has no effect here, and the note says what posttrain does instead (printed once);
  only   accepted when the value is one of `allowed` (what posttrain does anyway); any other value is rejected
         with the reason;
  map    the value is set on posttrain's key `target` (`{0}`, `{1}` = the segments matched by `*`);
docs/config.md is generated from this module (`python -m posttrain.config.keytable > docs/config.md`); a test
fails when it is stale or when a key of the familiar schema matches no rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    pattern: str  # dotted key; `*` matches one segment, `**` any number (also none)
    kind: str  # note | only | map
    why: str = ""
    allowed: tuple = ()
    target: str | None = None


ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")
ACTOR_REF = ROLES[:2]
TRAINED = ("actor_rollout_ref.actor", "critic")
NOT_RAY = "posttrain starts its own processes (torch.distributed) and does not use Ray"
ENGINE = "a knob of the vLLM/SGLang engines; posttrain's decoding engine sizes its cache per call"
PROFILER = ("posttrain has no profiler hook; run py-spy or torch.profiler around `posttrain train` "
            "(docs/performance.md shows how)")
MEGATRON_LAYOUT = ("Megatron's pipeline/context/expert parallel have no equivalent here: those devices shard the "
                   "model with FSDP2 instead (tensor parallel maps onto actor.fsdp_config.tp_size)")
DIST_CKPT = ("a Megatron checkpoint converted from the Hugging Face weights, for faster loading; posttrain reads the "
             "Hugging Face weights at model.path")
SINGLE_TURN = "posttrain's rollout is single-turn generation; multi-turn tool rollouts are not supported"
VL = "vision-language rows are read as the model's own image processor decides (images only, no video)"
NO_SP = ("sequence parallelism is not supported: each device holds whole sequences (use_dynamic_bsz and gradient "
         "checkpointing bound the memory), and the devices train as FSDP2 data-parallel ranks")
TRANSFORMERS = "posttrain computes log-probs and entropy in chunks on the transformers model itself"


def _roles(suffix: str, kind: str, why: str = "", allowed: tuple = (), roles=ROLES) -> list[Rule]:
    return [Rule(f"{r}.{suffix}", kind, why, allowed) for r in roles]


RULES: list[Rule] = [
    # ---- class paths and free-form engine sections
    Rule("**._target_", "note", "names an implementing class in the other framework; posttrain's keys are plain data"),
    Rule("global_profiler.**", "note", PROFILER),
    *_roles("profiler.**", "note", PROFILER),
    Rule("actor_rollout_ref.rollout.profiler.**", "note", PROFILER),
    Rule("actor_rollout_ref.*.profile.**", "note", PROFILER),
    Rule("actor_rollout_ref.profiler.**", "note", PROFILER),
    Rule("trainer.controller_nsight_options.**", "note", PROFILER),
    Rule("trainer.worker_nsight_options.**", "note", PROFILER),
    Rule("trainer.npu_profile.**", "note", PROFILER),
    Rule("trainer.profile_steps", "note", PROFILER),
    Rule("ray_init.**", "note", NOT_RAY),
    Rule("ray_kwargs.**", "note", NOT_RAY),
    Rule("trainer.ray_wait_register_center_timeout", "note", NOT_RAY),
    Rule("transfer_queue.enable", "only", "the transfer queue is part of a Ray data plane; posttrain passes batches "
         "in process", (False,)),
    Rule("**.nccl_timeout", "note", "posttrain uses torch.distributed's default collective timeout"),

    # ---- Megatron layouts onto FSDP2 x tensor parallel
    Rule("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "map",
         "Megatron tensor parallel = posttrain's tensor parallel",
         target="actor_rollout_ref.actor.fsdp_config.tp_size"),
    *_roles("megatron.tensor_model_parallel_size", "note",
            "every role uses the actor's tensor-parallel layout (actor.megatron.tensor_model_parallel_size)",
            roles=ROLES[1:]),
    *_roles("megatron.pipeline_model_parallel_size", "note", MEGATRON_LAYOUT),
    *_roles("megatron.virtual_pipeline_model_parallel_size", "note", MEGATRON_LAYOUT),
    *_roles("megatron.context_parallel_size", "note", MEGATRON_LAYOUT),
    *_roles("megatron.expert_model_parallel_size", "note", MEGATRON_LAYOUT),
    *_roles("megatron.expert_tensor_parallel_size", "note", MEGATRON_LAYOUT),
    *_roles("megatron.sequence_parallel", "note", "posttrain's tensor-parallel plan splits attention and MLP "
            "projections; activations between them are not split by sequence"),
    Rule("actor_rollout_ref.*.megatron.param_offload", "map", "keep weights in CPU memory",
         target="actor_rollout_ref.{0}.fsdp_config.param_offload"),
    Rule("actor_rollout_ref.actor.megatron.optimizer_offload", "map", "keep Adam state in CPU memory",
         target="actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
    Rule("critic.megatron.param_offload", "map", "keep weights in CPU memory",
         target="critic.model.fsdp_config.param_offload"),
    Rule("critic.megatron.optimizer_offload", "map", "keep Adam state in CPU memory",
         target="critic.model.fsdp_config.optimizer_offload"),
    *_roles("megatron.grad_offload", "note", "gradients follow fsdp_config.param_offload (FSDP2 CPU offload)",
            roles=ROLES[:3]),
    *_roles("megatron.use_distributed_optimizer", "note", "FSDP2 shards the optimizer state over the "
            "data-parallel ranks always"),
    *_roles("megatron.use_dist_checkpointing", "note", DIST_CKPT),
    *_roles("megatron.dist_checkpointing_path", "note", DIST_CKPT),
    *_roles("megatron.dist_checkpointing_prefix", "note", DIST_CKPT),
    *_roles("megatron.dtype", "note", "the compute dtype is actor_rollout_ref.model.dtype (and "
            "fsdp_config.mixed_precision.param_dtype when sharded)"),
    *_roles("megatron.seed", "note", "seeds come from trainer.seed"),
    *_roles("megatron.use_mbridge", "note", "posttrain loads Hugging Face models directly, no bridge"),
    *_roles("megatron.vanilla_mbridge", "note", "posttrain loads Hugging Face models directly, no bridge"),
    *_roles("megatron.use_remove_padding", "note", TRANSFORMERS),
    *_roles("megatron.forward_only", "note", "the role decides whether it trains", roles=ROLES[:3]),
    *_roles("megatron.override_transformer_config.**", "note", "Megatron kernel, fusion and recompute settings; "
            "posttrain runs the transformers model (activation checkpointing: model.enable_gradient_checkpointing)"),
    *_roles("megatron.override_ddp_config.**", "note", "Megatron DDP settings; posttrain uses FSDP2", roles=ROLES[:3]),
    *_roles("megatron.override_mcore_model_config.**", "note", "Megatron model settings; posttrain runs the "
            "transformers model (use model.override_config for its config)", roles=ROLES[:3]),
    Rule("actor_rollout_ref.ref.megatron.optimizer_offload", "note", "the reference has no optimizer"),
    Rule("reward_model.megatron.**", "note", "the reward model runs as a transformers model (FSDP2 when sharded)"),
    *_roles("load_weight", "only", "posttrain always starts from the model's weights", (True,)),

    # ---- FSDP engine knobs of every role
    Rule("reward_model.model.fsdp_config.**", "note", "the reward model is sharded with FSDP2 over the ranks like "
         "the reference, in the rollout dtype; its own fsdp settings (param_offload too) are not read"),
    Rule("**.fsdp_config.dtype", "note", "posttrain: fsdp_config.model_dtype (stored weights) and "
         "fsdp_config.mixed_precision.param_dtype / model.dtype (compute)"),
    Rule("**.fsdp_config.strategy", "only", "FSDP2 is posttrain's sharding", ("fsdp", "fsdp2")),
    Rule("**.fsdp_config.forward_prefetch", "note", "FSDP2 prefetches the next layer's gather by itself"),
    Rule("**.fsdp_config.use_orig_params", "note", "FSDP2 keeps the original parameters always"),
    Rule("**.fsdp_config.offload_policy", "note", "fsdp_config.param_offload selects FSDP2's CPUOffloadPolicy"),
    Rule("**.fsdp_config.wrap_policy.min_num_params", "note", "FSDP2 shards each decoder layer, then the root"),
    Rule("**.fsdp_config.seed", "note", "seeds come from trainer.seed"),
    Rule("**.fsdp_config.full_determinism", "note", "posttrain's seeded runs repeat on the same hardware; "
         "no extra deterministic-kernel switch"),
    Rule("**.fsdp_config.forward_only", "note", "the role decides whether it trains"),
    Rule("**.fsdp_config.entropy_checkpointing", "note", TRANSFORMERS),
    Rule("**.fsdp_config.entropy_from_logits_with_chunking", "note", TRANSFORMERS),
    Rule("**.fsdp_config.use_torch_compile", "note", "posttrain runs eagerly (compile time outweighs the gain at "
         "these sizes; docs/performance.md)"),
    Rule("**.fsdp_config.ulysses_sequence_parallel_size", "note", NO_SP),

    # ---- actor / ref / critic
    *_roles("entropy_checkpointing", "note", TRANSFORMERS, roles=ACTOR_REF),
    *_roles("entropy_from_logits_with_chunking", "note", TRANSFORMERS, roles=ACTOR_REF),
    *_roles("use_torch_compile", "note", "posttrain runs eagerly (compile time outweighs the gain at these sizes; "
            "docs/performance.md)", roles=ACTOR_REF),
    *_roles("rollout_n", "note", "always actor_rollout_ref.rollout.n", roles=ROLES[:3]),
    *_roles("router_replay.mode", "only", "MoE router replay is not supported", ("disabled",), roles=ACTOR_REF),
    *_roles("router_replay.record_file", "only", "MoE router replay is not supported", (None,), roles=ACTOR_REF),
    *_roles("router_replay.replay_file", "only", "MoE router replay is not supported", (None,), roles=ACTOR_REF),
    *_roles("ulysses_sequence_parallel_size", "note", NO_SP),
    *_roles("data_loader_seed", "note", "the mini-batch shuffle (actor.shuffle) is seeded by trainer.seed",
            roles=TRAINED),
    Rule("actor_rollout_ref.actor.checkpoint.async_save", "only", "checkpoints are written synchronously and "
         "atomically", (False,)),
    Rule("critic.checkpoint.*", "note", "one checkpoint holds every role; actor.checkpoint.* decides its contents"),
    Rule("actor_rollout_ref.actor.ppo_micro_batch_size", "only",
         "the global micro-batch size is deprecated; use actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
         (None,)),
    Rule("actor_rollout_ref.rollout.log_prob_micro_batch_size", "only",
         "use actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", (None,)),
    Rule("actor_rollout_ref.ref.log_prob_micro_batch_size", "only",
         "use actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", (None,)),
    Rule("critic.ppo_micro_batch_size", "only", "use critic.ppo_micro_batch_size_per_gpu", (None,)),
    Rule("critic.forward_micro_batch_size", "only", "use critic.ppo_micro_batch_size_per_gpu", (None,)),
    Rule("reward_model.micro_batch_size", "only", "use reward_model.micro_batch_size_per_gpu", (None,)),
    Rule("critic.forward_micro_batch_size_per_gpu", "note", "the critic's value pass uses "
         "critic.ppo_micro_batch_size_per_gpu"),
    Rule("critic.forward_max_token_len_per_gpu", "note", "the critic's value pass uses "
         "critic.ppo_max_token_len_per_gpu"),
    Rule("actor_rollout_ref.actor.calculate_entropy", "note", "the actor always reports actor/entropy"),
    Rule("actor_rollout_ref.actor.calculate_sum_pi_squared", "note", "computed when the estimator needs it"),
    Rule("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "note", TRANSFORMERS),
    Rule("actor_rollout_ref.actor.use_fused_kernels", "note", "follows actor_rollout_ref.model.use_fused_kernels"),
    Rule("actor_rollout_ref.actor.use_remove_padding", "note", TRANSFORMERS + " on padded rows (no packed "
         "forward); only real tokens are scored"),
    Rule("actor_rollout_ref.actor.use_prefix_grouper", "note", "posttrain always computes a prompt once for its "
         "rollout.n responses (shared-prompt passes, docs/performance.md)"),
    Rule("actor_rollout_ref.ref.strategy", "note", "the reference uses the actor's strategy"),
    Rule("actor_rollout_ref.actor.optim.clip_grad", "map", "the gradient-norm clip",
         target="actor_rollout_ref.actor.grad_clip"),
    Rule("critic.optim.clip_grad", "map", "the gradient-norm clip", target="critic.grad_clip"),
    *[Rule(f"{r}.optim.optimizer", "only", "posttrain's optimizer is torch AdamW", ("AdamW", "adamw"))
      for r in ("actor_rollout_ref.actor", "critic")],
    *[Rule(f"{r}.optim.optimizer_impl", "only", "posttrain's optimizer is torch AdamW", ("torch.optim",))
      for r in ("actor_rollout_ref.actor", "critic")],
    *[Rule(f"{r}.optim.num_cycles", "only", "the cosine schedule is a half cycle", (0.5,))
      for r in ("actor_rollout_ref.actor", "critic")],
    *[Rule(f"{r}.optim.override_optimizer_config.**", "note", "Megatron optimizer settings; posttrain uses torch "
           "AdamW (CPU state: fsdp_config.optimizer_offload)") for r in ("actor_rollout_ref.actor", "critic")],
    *[Rule(f"{r}.optim.override_optimizer_config", "only", "Megatron optimizer settings; posttrain uses torch "
           "AdamW", (None, {})) for r in ("actor_rollout_ref.actor", "critic")],
    *[Rule(f"{r}.optim.{k}", "note", "a Megatron scheduler setting; posttrain's schedule is warmup then constant "
           "or cosine (optim.lr_scheduler_type, min_lr_ratio)")
      for r in ("actor_rollout_ref.actor", "critic")
      for k in ("lr_decay_steps", "lr_decay_style", "lr_warmup_init", "lr_wsd_decay_steps", "lr_wsd_decay_style",
                "min_lr", "use_checkpoint_opt_param_scheduler", "weight_decay_incr_style")],

    # ---- models
    Rule("actor_rollout_ref.model.override_config.model_config.*", "map", "Megatron's spelling of a model config "
         "entry", target="actor_rollout_ref.model.override_config.{0}"),
    Rule("actor_rollout_ref.model.override_config.model_config", "map", "Megatron's spelling of model config entries",
         target="actor_rollout_ref.model.override_config"),
    Rule("critic.model.override_config.model_config", "map", "Megatron's spelling of model config entries",
         target="critic.model.override_config"),
    Rule("critic.model.override_config.model_config.*", "map", "Megatron's spelling of a model config entry",
         target="critic.model.override_config.{0}"),
    Rule("*.model.override_config.moe_config.freeze_moe_router", "only", "the MoE router trains with the model",
         (False,)),
    Rule("critic.model.override_config.moe_config.freeze_moe_router", "only", "the MoE router trains with the "
         "model", (False,)),
    Rule("actor_rollout_ref.model.lora.rank", "map", "LoRA rank", target="actor_rollout_ref.model.lora_rank"),
    Rule("actor_rollout_ref.model.lora.alpha", "map", "LoRA scale", target="actor_rollout_ref.model.lora_alpha"),
    Rule("actor_rollout_ref.model.lora.type", "only", "posttrain trains plain LoRA (peft)", ("lora",)),
    Rule("actor_rollout_ref.model.lora.adapter_path", "only", "starting from a saved adapter is not supported",
         (None,)),
    Rule("actor_rollout_ref.model.lora.dropout", "only", "posttrain's LoRA has no dropout", (0, 0.0)),
    Rule("actor_rollout_ref.model.lora.merge", "note", "posttrain merges LoRA into the decoding weights each step"),
    Rule("actor_rollout_ref.model.lora.target_modules", "note", "Megatron module names; posttrain adapts "
         "actor_rollout_ref.model.target_modules (default all-linear)"),
    Rule("actor_rollout_ref.model.lora.exclude_modules", "only", "use actor_rollout_ref.model.target_modules", ((),)),
    Rule("actor_rollout_ref.model.lora.**", "note", "Megatron LoRA details; posttrain's LoRA is peft's, applied "
         "to the language model"),
    Rule("critic.model.lora.rank", "only", "the critic trains all its weights (no LoRA critic)", (0,)),
    Rule("critic.model.lora.**", "note", "the critic trains all its weights (no LoRA critic)"),
    Rule("critic.model.lora_rank", "only", "the critic trains all its weights (no LoRA critic)", (0,)),
    Rule("critic.model.lora_alpha", "note", "the critic trains all its weights (no LoRA critic)"),
    Rule("critic.model.target_modules", "note", "the critic trains all its weights (no LoRA critic)"),
    Rule("actor_rollout_ref.model.lora_adapter_path", "only", "starting from a saved adapter is not supported",
         (None,)),
    Rule("actor_rollout_ref.model.exclude_modules", "only", "list the adapted modules in "
         "actor_rollout_ref.model.target_modules instead", (None,)),
    Rule("actor_rollout_ref.model.custom_chat_template", "only", "put the template in the tokenizer folder "
         "(chat_template.jinja) instead", (None,)),
    Rule("*.model.external_lib", "only", "posttrain imports no extra model library; register the architecture "
         "with transformers (or use trust_remote_code)", (None,)),
    Rule("critic.model.external_lib", "only", "posttrain imports no extra model library", (None,)),
    Rule("actor_rollout_ref.model.hf_config_path", "only", "the config is read from model.path", (None,)),
    Rule("actor_rollout_ref.model.fused_kernel_options.**", "note", TRANSFORMERS),
    Rule("**.tiled_mlp.enabled", "only", "tiled MLP is not supported", (False,)),
    Rule("**.tiled_mlp.num_shards", "note", "tiled MLP is not supported"),
    Rule("**.use_shm", "note", "models are read from disk (no shared-memory copy)"),
    Rule("actor_rollout_ref.model.mtp.enable", "only", "multi-token prediction is not supported", (False,)),
    Rule("actor_rollout_ref.model.mtp.enable_train", "only", "multi-token prediction is not supported", (False,)),
    Rule("actor_rollout_ref.model.mtp.enable_rollout", "only", "multi-token prediction is not supported", (False,)),
    Rule("actor_rollout_ref.model.mtp.**", "note", "multi-token prediction is not supported"),
    Rule("*.model.enable_activation_offload", "note", "activation checkpointing "
         "(model.enable_gradient_checkpointing, on by default) bounds activation memory instead"),
    Rule("critic.model.enable_activation_offload", "note", "activation checkpointing "
         "(critic.model.enable_gradient_checkpointing, on by default) bounds activation memory instead"),
    Rule("actor_rollout_ref.model.use_liger", "note", TRANSFORMERS + ", which saves the memory fused kernels save"),
    Rule("actor_rollout_ref.model.use_fused_kernels", "note", TRANSFORMERS + ", which saves the memory fused "
         "kernels save"),

    # ---- rollout
    Rule("actor_rollout_ref.rollout.multi_turn.enable", "only", SINGLE_TURN, (False,)),
    Rule("actor_rollout_ref.rollout.multi_turn.**", "note", SINGLE_TURN),
    Rule("actor_rollout_ref.rollout.agent.default_agent_loop", "only", SINGLE_TURN, ("single_turn_agent",)),
    Rule("actor_rollout_ref.rollout.agent.agent_loop_config_path", "only", SINGLE_TURN, (None,)),
    Rule("actor_rollout_ref.rollout.agent.custom_async_server.*", "only", SINGLE_TURN, (None,)),
    Rule("actor_rollout_ref.rollout.agent.num_workers", "note", "posttrain generates in the training processes"),
    Rule("actor_rollout_ref.rollout.engine_kwargs.**", "note", ENGINE),
    Rule("actor_rollout_ref.rollout.engine_kwargs", "note", ENGINE),
    Rule("actor_rollout_ref.rollout.checkpoint_engine.**", "note", "posttrain's engine reads the training weights "
         "in place (no weight transfer)"),
    Rule("actor_rollout_ref.rollout.prometheus.enable", "only", "no metrics server; metrics go to trainer.logger",
         (False,)),
    Rule("actor_rollout_ref.rollout.prometheus.**", "note", "no metrics server; metrics go to trainer.logger"),
    Rule("actor_rollout_ref.rollout.trace.**", "note", "no rollout tracing; trainer.rollout_data_dir dumps the "
         "generations"),
    Rule("actor_rollout_ref.rollout.layer_name_map.**", "note", "posttrain's engine reads the training weights "
         "in place (no weight transfer)"),
    *[Rule(f"actor_rollout_ref.rollout.{k}", "note", ENGINE)
      for k in ("cudagraph_capture_sizes", "data_parallel_size", "disable_log_stats", "enable_prefix_caching",
                "layered_summon", "max_model_len", "multi_stage_wake_up", "scheduling_policy", "skip_tokenizer_init",
                "expert_parallel_size", "pipeline_model_parallel_size", "skip_dump_dir")],
    Rule("actor_rollout_ref.rollout.update_weights_bucket_megabytes", "note", "posttrain's engine reads the training "
         "weights in place (no weight transfer)"),
    Rule("actor_rollout_ref.ref.model", "only", "the reference is the actor's starting model", (None,)),
    Rule("actor_rollout_ref.rollout.logprobs_mode", "note", "the sampled tokens' log-probs are those of the "
         "processed (temperature, top-k, top-p) distribution"),
    Rule("actor_rollout_ref.rollout.quantization", "only", "posttrain's engine decodes in model.dtype / rollout.dtype; "
         "quantized decoding is not supported", (None,)),
    Rule("actor_rollout_ref.rollout.quantization_config_file", "only", "quantized decoding is not supported",
         (None,)),
    Rule("actor_rollout_ref.rollout.over_sample_rate", "only", "every prompt is sampled rollout.n times", (0, 0.0)),
    Rule("actor_rollout_ref.rollout.skip_rollout", "only", "rollouts are always generated", (False,)),
    Rule("actor_rollout_ref.rollout.enable_rollout_routing_replay", "only", "MoE router replay is not supported",
         (False,)),
    Rule("actor_rollout_ref.rollout.mtp", "only", "multi-token prediction is not supported", (None,)),

    # ---- data
    Rule("data.custom_cls.*", "only", "rows are read by posttrain's dataset (parquet/jsonl in the standard layout)",
         (None,)),
    Rule("data.datagen.*", "only", "dynamic data generation is not supported", (None,)),
    Rule("data.sampler.*", "only", "prompts are sampled by posttrain's seeded shuffle (data.shuffle, data.seed)",
         (None,)),
    Rule("data.dataloader_num_workers", "note", "rows are tokenized once at start-up; no loader workers"),
    Rule("data.filter_overlong_prompts_workers", "note", "rows are tokenized once at start-up in the main process"),
    Rule("data.image_patch_size", "note", VL),
    Rule("data.video_key", "note", VL),
    Rule("data.return_multi_modal_inputs", "note", VL),
    Rule("data.return_full_prompt", "note", "scorers receive the raw chat with data.return_raw_chat"),
    Rule("data.return_raw_input_ids", "note", "the reward model reads its own tokenization"),
    Rule("data.tokenizer", "only", "prompts are tokenized with the actor's tokenizer", (None,)),
    Rule("data.tool_config_path", "only", SINGLE_TURN, (None,)),
    Rule("data.trust_remote_code", "note", "follows actor_rollout_ref.model.trust_remote_code"),
    Rule("data.use_shm", "note", "data files are read from disk"),
    Rule("data.validation_shuffle", "note", "validation runs over every row in file order"),

    # ---- rewards
    Rule("reward_model.use_reward_loop", "note", "posttrain scores rules in its own scorer pool "
         "(reward_model.num_workers) and runs the reward model in the training processes"),
    Rule("reward_model.reward_loop_source", "note", "posttrain scores in its own scorer pool"),
    Rule("reward_model.reward_loop_module_path", "only", "use custom_reward_function.path", (None,)),
    Rule("reward_model.reward_loop_class_name", "only", "use custom_reward_function.path", (None,)),
    Rule("reward_model.reward_kwargs.overlong_buffer_cfg.*", "map", "DAPO overlong shaping",
         target="reward_model.overlong_buffer.{0}"),
    Rule("reward_model.reward_kwargs.max_resp_len", "note", "the overlong shaping uses data.max_response_length"),
    Rule("reward_model.enable_resource_pool", "note", "the reward model shares the training processes' devices"),
    Rule("reward_model.n_gpus_per_node", "note", "the reward model shares the training processes' devices"),
    Rule("reward_model.nnodes", "note", "the reward model shares the training processes' devices"),
    Rule("reward_model.strategy", "note", "the reward model is sharded with FSDP2 like the reference"),
    Rule("reward_model.rollout.**", "note", "the reward model runs in the training processes: the scalar one with "
         "transformers, the generative judge (reward_model.judge.*, its sampling there) on posttrain's rollout engine"),
    Rule("reward_model.model.override_config", "note", "the reward model loads with its own config"),
    Rule("reward_model.model.use_fused_kernels", "note", "the reward model runs the transformers forward"),
    Rule("reward_model.model.use_remove_padding", "note", "the reward model runs on padded micro-batches, each cut "
         "to its longest row"),
    Rule("reward_manager.source", "only", "reward_model.reward_manager names the manager", ("register",)),
    Rule("reward_manager.module.path", "only", "use custom_reward_function.path", (None,)),
    Rule("reward_manager.name", "note", "reward_model.reward_manager names the manager"),
    Rule("reward_manager.module.name", "note", "reward_model.reward_manager names the manager"),

    # ---- algorithm
    Rule("algorithm.use_pf_ppo", "only", "PF-PPO (reweighting samples by reward) is not supported", (False,)),
    Rule("algorithm.pf_ppo.*", "note", "PF-PPO is not supported"),


    Rule("algorithm.rollout_correction.rollout_rs_threshold_lower", "only", "rejection sampling is not supported",
         (None,)),
    Rule("algorithm.rollout_correction.rollout_token_veto_threshold", "only", "the token veto is not supported",
         (None,)),
    Rule("algorithm.rollout_correction.use_policy_gradient", "only", "bypass mode runs the configured policy "
         "loss (loss_type=ppo_clip)", (False,)),
    Rule("algorithm.rollout_is_threshold", "map", "the older spelling of rollout correction's threshold",
         target="algorithm.rollout_correction.rollout_is_threshold"),
    Rule("algorithm.rollout_is", "only", "the older spelling: set algorithm.rollout_correction.rollout_is=token "
         "(or sequence) instead", (False,)),
    Rule("algorithm.rollout_is_level", "note", "the older spelling: algorithm.rollout_correction.rollout_is names the "
         "level"),
    Rule("algorithm.rollout_is_mode", "only", "weights are truncated (the only mode)", ("truncate",)),
    Rule("algorithm.rollout_is_threshold_lower", "only", "rejection sampling is not supported", (None,)),
    Rule("algorithm.rollout_is_veto_threshold", "note", "the token veto is not applied"),

    # ---- trainer
    Rule("trainer.default_hdfs_dir", "only", "checkpoints are written to trainer.default_local_dir (copy them "
         "elsewhere after the run)", (None,)),
    Rule("trainer.del_local_ckpt_after_load", "only", "local checkpoints are kept (trainer.max_actor_ckpt_to_keep "
         "prunes old ones)", (False,)),
    Rule("trainer.esi_redundant_time", "note", "checkpoints are written atomically at save_freq; a killed run "
         "resumes from the last one"),
    Rule("trainer.use_legacy_worker_impl", "note", "posttrain has one worker implementation"),
]


# ------------------------------------------------------------------ posttrain's own keys

DESCRIPTIONS: dict[str, str] = {
    'data.train_files':
        'parquet or jsonl file, or a list of them (rows in the layout of DESIGN.md)',
    'data.val_files':
        'validation files; null = no validation',
    'data.prompt_key':
        'column holding the chat messages (or a plain string)',
    'data.reward_fn_key':
        'column that selects the rule scorer',
    'data.max_prompt_length':
        'prompt tokens after the chat template',
    'data.max_response_length':
        'generated tokens; also `C` of `seq-mean-token-sum-norm`',
    'data.train_batch_size':
        'prompts per step (each sampled `rollout.n` times)',
    'data.val_batch_size':
        'prompts per validation generate call; null = all at once',
    'data.shuffle':
        'shuffle training prompts each epoch (seeded by `seed`)',
    'data.seed':
        'data order seed',
    'data.filter_overlong_prompts':
        'drop prompts longer than `max_prompt_length` at load time (counted)',
    'data.truncation':
        'too-long prompt: `error` (names file and row), `left`, `right`, `middle`',
    'data.return_raw_chat':
        'pass the chat messages to scorers as `extra_info["raw_prompt"]`',
    'data.image_key':
        'column holding a row\'s images (a list of bytes, {"bytes", "path"} structs or paths), one per `<image>` in '
        'the prompt; needs a vision-language model (its processor makes the image tokens)',
    'data.apply_chat_template_kwargs':
        "extra arguments of the tokenizer's chat template (e.g. `enable_thinking`, `reasoning_effort`)",
    'data.train_max_samples':
        'use only the first N usable training rows (-1 = all)',
    'data.val_max_samples':
        'use only the first N usable validation rows (-1 = all)',
    'data.missing_chat_template':
        'a tokenizer without a chat template: `error` (stop before training) or `join` (the message contents joined '
        'by newlines, for base models)',
    'actor_rollout_ref.hybrid_engine':
        'actor and rollout share weights (the only mode; False is rejected)',
    'actor_rollout_ref.model.path':
        'Hugging Face causal LM: a local directory or a hub id (`owner/name`, see above)',
    'actor_rollout_ref.model.tokenizer_path':
        "tokenizer directory or hub id, if not the model's",
    'actor_rollout_ref.model.trust_remote_code':
        'passed to `from_pretrained`',
    'actor_rollout_ref.model.use_remove_padding':
        'accepted for portability, no effect: there is no padding-free (packed) forward; each forward runs on '
        'padded rows, cut to the longest prompt and the longest response of its micro-batch. Log-probs, losses '
        'and metrics count only real response tokens either way',
    'actor_rollout_ref.model.enable_gradient_checkpointing':
        'activation checkpointing in the actor (and critic) forward',
    'actor_rollout_ref.model.lora_rank':
        '> 0 trains a LoRA adapter of this rank (peft) instead of all weights; the reference is then the same'
        ' model with the adapter off',
    'actor_rollout_ref.model.lora_alpha':
        'LoRA scale and the modules it adapts (`all-linear`, a comma-separated string or a list of names)',
    'actor_rollout_ref.model.target_modules':
        'LoRA scale and the modules it adapts (`all-linear`, a comma-separated string or a list of names)',
    'actor_rollout_ref.model.override_config':
        'entries set on the model config before loading (e.g. `attention_dropout`)',
    'actor_rollout_ref.model.dtype':
        'compute dtype: `auto` = bf16 where the hardware supports it (a CPU needs AVX512-BF16 or AMX), else fp32; '
        "or `bf16`, `fp16`, `fp32` (autocast in one process, FSDP's mixed precision when sharded). bf16 on a CPU "
        'without those instructions is emulated, tens of times slower than fp32: a warning at load says so',
    'actor_rollout_ref.actor.strategy':
        '`fsdp`/`fsdp2`: FSDP2 when sharded (see "Processes and sharding"); `megatron` is rejected',
    'actor_rollout_ref.actor.ppo_mini_batch_size':
        'prompts per optimizer step (whole prompt groups, split over the data-parallel ranks)',
    'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu':
        'responses per forward/backward; null = whole mini-batch',
    'actor_rollout_ref.actor.use_dynamic_bsz':
        'micro-batches of rows of similar length, each at most `ppo_max_token_len_per_gpu` padded positions (rows '
        'x (longest prompt + longest response): the forward runs on padded rows; a longer row alone gets its own), '
        'as many on every rank',
    'actor_rollout_ref.actor.ppo_max_token_len_per_gpu':
        'token budget of a dynamic micro-batch, in padded positions (rows x padded width)',
    'actor_rollout_ref.actor.ppo_epochs':
        'passes over each batch',
    'actor_rollout_ref.actor.shuffle':
        'shuffle the prompt groups (seeded, restored on resume) before splitting into mini-batches',
    'actor_rollout_ref.actor.grad_clip':
        'gradient-norm clip',
    'actor_rollout_ref.actor.clip_ratio':
        'PPO clip; fallback for `clip_ratio_low` / `clip_ratio_high`',
    'actor_rollout_ref.actor.clip_ratio_low':
        'asymmetric clip (DAPO clip-higher)',
    'actor_rollout_ref.actor.clip_ratio_high':
        'asymmetric clip (DAPO clip-higher)',
    'actor_rollout_ref.actor.clip_ratio_c':
        'dual-clip bound for negative advantages (> 1)',
    'actor_rollout_ref.actor.loss_agg_mode':
        '`token-mean`, `token-sum` (no normaliser), `seq-mean-token-sum`, `seq-mean-token-mean`, '
        '`seq-mean-token-sum-norm`',
    'actor_rollout_ref.actor.loss_scale_factor':
        '`C` of `seq-mean-token-sum-norm` (null = `data.max_response_length`)',
    'actor_rollout_ref.actor.entropy_coeff':
        'entropy bonus coefficient',
    'actor_rollout_ref.actor.freeze_vision_tower':
        'vision-language models: the vision encoder (and its merger) is not trained; an error for a text-only model',
    'actor_rollout_ref.actor.use_kl_loss':
        'add `kl_loss_coef * agg(kl(logp, logp_ref))` to the actor loss (loads the reference)',
    'actor_rollout_ref.actor.kl_loss_coef':
        'its coefficient',
    'actor_rollout_ref.actor.kl_loss_type':
        '`kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`, each with optional `+`',
    'actor_rollout_ref.actor.policy_loss.loss_mode':
        '`vanilla` (PPO dual-clip), `gpg`, `gspo`, `cispo`, `clip_cov`, `kl_cov`, `geo_mean`, `sapo`, '
        '`dppo_tv`, `dppo_kl`, or a registered loss (docs/algorithms.md)',
    'actor_rollout_ref.actor.policy_loss.clip_cov_ratio':
        '`clip_cov`: share of tokens whose gradient is dropped',
    'actor_rollout_ref.actor.policy_loss.clip_cov_lb':
        '`clip_cov`: lower end of the covariance window of the candidates',
    'actor_rollout_ref.actor.policy_loss.clip_cov_ub':
        '`clip_cov`: upper end of the covariance window of the candidates',
    'actor_rollout_ref.actor.policy_loss.kl_cov_ratio':
        '`kl_cov`: share of tokens (largest covariance) penalised',
    'actor_rollout_ref.actor.policy_loss.ppo_kl_coef':
        '`kl_cov`: coefficient of the `|log-ratio|` penalty',
    'actor_rollout_ref.actor.tau_pos':
        '`sapo`: gate temperature for positive advantages',
    'actor_rollout_ref.actor.tau_neg':
        '`sapo`: gate temperature for negative advantages',
    'actor_rollout_ref.actor.calculate_sum_pi_squared':
        'accepted for portability: `sum_v pi_v^2` is computed whenever the estimator reads it '
        '(`optimal_token_baseline`)',
    'actor_rollout_ref.actor.optim.lr':
        'AdamW learning rate',
    'actor_rollout_ref.actor.optim.lr_warmup_steps':
        'linear warmup steps; -1 = use `lr_warmup_steps_ratio`',
    'actor_rollout_ref.actor.optim.lr_warmup_steps_ratio':
        'warmup as a share of the total steps',
    'actor_rollout_ref.actor.optim.warmup_style':
        '`constant` or `cosine` after warmup',
    'actor_rollout_ref.actor.optim.lr_scheduler_type':
        '`constant` or `cosine` after warmup',
    'actor_rollout_ref.actor.optim.min_lr_ratio':
        'cosine floor as a share of `lr`',
    'actor_rollout_ref.actor.optim.weight_decay':
        'AdamW weight decay',
    'actor_rollout_ref.actor.optim.betas':
        'AdamW betas',
    'actor_rollout_ref.actor.optim.total_training_steps':
        "scheduler horizon; -1 = the trainer's step count",
    'actor_rollout_ref.actor.fsdp_config.param_offload':
        'keep parameters, gradients and Adam state in CPU memory (FSDP2 `CPUOffloadPolicy`; shards even one '
        'process)',
    'actor_rollout_ref.actor.fsdp_config.optimizer_offload':
        'keep Adam state in CPU memory between optimizer steps (on a GPU; nothing to move on a CPU run)',
    'actor_rollout_ref.actor.fsdp_config.fsdp_size':
        'ranks per FSDP shard group (-1 = all data-parallel ranks; a divisor gives HSDP: shard within groups,'
        ' replicate across them)',
    'actor_rollout_ref.actor.fsdp_config.tp_size':
        "tensor-parallel degree: attention and MLP projections split over this many ranks (the model's own "
        'plan, colwise/rowwise); a 2-D mesh with FSDP over the rest. The same layout holds for ref and critic',
    'actor_rollout_ref.actor.fsdp_config.model_dtype':
        "dtype of the stored (sharded) weights and so of the optimizer's parameters",
    'actor_rollout_ref.actor.fsdp_config.reshard_after_forward':
        'free each gathered layer after its forward (False keeps it until backward: faster, more memory)',
    'actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype':
        'FSDP2 `MixedPrecisionPolicy`: compute dtype (null = `model.dtype`) and gradient-reduction dtype; '
        '`buffer_dtype` is accepted and has no effect',
    'actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype':
        'FSDP2 `MixedPrecisionPolicy`: compute dtype (null = `model.dtype`) and gradient-reduction dtype; '
        '`buffer_dtype` is accepted and has no effect',
    'actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype':
        'FSDP2 `MixedPrecisionPolicy`: compute dtype (null = `model.dtype`) and gradient-reduction dtype; '
        '`buffer_dtype` is accepted and has no effect',
    'actor_rollout_ref.actor.checkpoint.save_contents':
        'what a checkpoint holds; add `hf_model` to also write a plain Hugging Face folder '
        '(`actor/huggingface`) of each saved checkpoint, by rank 0 in the background while training goes on '
        '(a failed export is a warning: the checkpoint is saved)',
    'actor_rollout_ref.actor.checkpoint.load_contents':
        'what a resume loads (null = `save_contents`)',
    'actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu':
        'responses per reference forward',
    'actor_rollout_ref.ref.log_prob_use_dynamic_bsz':
        'token-budget micro-batches',
    'actor_rollout_ref.ref.log_prob_max_token_len_per_gpu':
        'token-budget micro-batches',
    'actor_rollout_ref.ref.fsdp_config.param_offload':
        'keep the reference weights in CPU memory between uses (FSDP2 CPU offload when sharded; in one plain '
        'process on a GPU the model moves in and out per step; nothing to move on a CPU run)',
    'actor_rollout_ref.ref.fsdp_config.optimizer_offload':
        'accepted for portability: the reference has no optimizer',
    'actor_rollout_ref.ref.fsdp_config.fsdp_size':
        "as the actor's; must be left unset or equal the actor's",
    'actor_rollout_ref.ref.fsdp_config.tp_size':
        "as the actor's; must be left unset or equal the actor's",
    'actor_rollout_ref.ref.fsdp_config.model_dtype':
        "as the actor's keys; `fsdp_size` / `tp_size` must be left unset or equal the actor's",
    'actor_rollout_ref.ref.fsdp_config.reshard_after_forward':
        "as the actor's keys; `fsdp_size` / `tp_size` must be left unset or equal the actor's",
    'actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype':
        "as the actor's key",
    'actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype':
        "as the actor's key",
    'actor_rollout_ref.ref.fsdp_config.mixed_precision.buffer_dtype':
        "as the actor's key",
    'actor_rollout_ref.rollout.name':
        '`posttrain` or `hf`; `vllm`/`sglang` are accepted and run on `posttrain` (see above)',
    'actor_rollout_ref.rollout.mode':
        'engine-only',
    'actor_rollout_ref.rollout.n':
        'samples per prompt',
    'actor_rollout_ref.rollout.temperature':
        'sampling; `top_k=-1` = off',
    'actor_rollout_ref.rollout.top_p':
        'sampling; `top_k=-1` = off',
    'actor_rollout_ref.rollout.top_k':
        'sampling; `top_k=-1` = off',
    'actor_rollout_ref.rollout.do_sample':
        'False = greedy',
    'actor_rollout_ref.rollout.response_length':
        'generated tokens: null or equal to `data.max_response_length`, which bounds generation, the overlong '
        'penalty and the `seq-mean-token-sum-norm` constant alike; another value is rejected',
    'actor_rollout_ref.rollout.prompt_length':
        'null or equal to `data.max_prompt_length` (which bounds prompts); another value is rejected',
    'actor_rollout_ref.rollout.dtype':
        'dtype of generation (as `model.dtype`)',
    'actor_rollout_ref.rollout.ignore_eos':
        'keep generating past EOS up to `response_length`',
    'actor_rollout_ref.rollout.calculate_log_probs':
        "the engine also returns each sampled token's log-prob under the distribution it was drawn from "
        '(`rollout_log_probs`), and `logp_old` is computed in its own pass (otherwise skipped when one '
        'mini-batch and one epoch make it `sg(logp)`); the gap between the two is logged as '
        '`training/rollout_probs_diff_max` / `_mean` / `_std` and `training/rollout_actor_probs_pearson_corr` '
        '(docs/algorithms.md)',
    'actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu':
        'responses per old-log-prob forward',
    'actor_rollout_ref.rollout.log_prob_use_dynamic_bsz':
        'token-budget micro-batches',
    'actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu':
        'token-budget micro-batches',
    'actor_rollout_ref.rollout.micro_batch_size':
        'prompts generated in one `generate` call; null = all',
    'actor_rollout_ref.rollout.tensor_model_parallel_size':
        'engine-only (see above)',
    'actor_rollout_ref.rollout.gpu_memory_utilization':
        'engine-only (see above)',
    'actor_rollout_ref.rollout.enforce_eager':
        "False: on a GPU, posttrain's engine replays each decoding step as a CUDA graph (one process; sharded and "
        'MoE models decode eagerly); True: eager steps',
    'actor_rollout_ref.rollout.free_cache_engine':
        'engine-only (see above)',
    'actor_rollout_ref.rollout.load_format':
        'engine-only (see above)',
    'actor_rollout_ref.rollout.max_num_batched_tokens':
        'engine-only (see above)',
    'actor_rollout_ref.rollout.max_num_seqs':
        'engine-only (see above)',
    'actor_rollout_ref.rollout.enable_chunked_prefill':
        'engine-only (see above)',
    'actor_rollout_ref.rollout.val_kwargs.n':
        'validation sampling',
    'actor_rollout_ref.rollout.val_kwargs.do_sample':
        'validation sampling',
    'actor_rollout_ref.rollout.val_kwargs.temperature':
        'validation sampling',
    'actor_rollout_ref.rollout.val_kwargs.top_p':
        'validation sampling',
    'actor_rollout_ref.rollout.val_kwargs.top_k':
        'validation sampling',
    'critic.enable':
        'null = on exactly when the estimator needs a critic',
    'critic.strategy':
        "as the actor's",
    'critic.optim.lr':
        "as the actor's optimizer keys",
    'critic.optim.lr_warmup_steps':
        "as the actor's optimizer keys",
    'critic.optim.lr_warmup_steps_ratio':
        "as the actor's optimizer keys",
    'critic.optim.warmup_style':
        "as the actor's optimizer keys",
    'critic.optim.lr_scheduler_type':
        "as the actor's optimizer keys",
    'critic.optim.min_lr_ratio':
        "as the actor's optimizer keys",
    'critic.optim.weight_decay':
        "as the actor's optimizer keys",
    'critic.optim.betas':
        "as the actor's optimizer keys",
    'critic.optim.total_training_steps':
        "as the actor's optimizer keys",
    'critic.model.path':
        "value-model backbone (directory or hub id); null = the actor's path",
    'critic.model.tokenizer_path':
        "must be the actor's tokenizer (the critic reads the actor's token ids); another one is rejected",
    'critic.model.trust_remote_code':
        "as the actor's",
    'critic.model.use_remove_padding':
        "as the actor's",
    'critic.model.enable_gradient_checkpointing':
        "as the actor's",
    'critic.model.override_config':
        "as the actor's",
    'critic.model.fsdp_config.param_offload':
        "as the actor's",
    'critic.model.fsdp_config.optimizer_offload':
        "as the actor's",
    'critic.model.fsdp_config.fsdp_size':
        "as the actor's",
    'critic.model.fsdp_config.tp_size':
        "as the actor's",
    'critic.model.fsdp_config.model_dtype':
        "as the actor's",
    'critic.model.fsdp_config.reshard_after_forward':
        "as the actor's",
    'critic.model.fsdp_config.mixed_precision.param_dtype':
        "as the actor's",
    'critic.model.fsdp_config.mixed_precision.reduce_dtype':
        "as the actor's",
    'critic.model.fsdp_config.mixed_precision.buffer_dtype':
        "as the actor's",
    'critic.ppo_mini_batch_size':
        "null = the actor's",
    'critic.ppo_micro_batch_size_per_gpu':
        "null = the actor's",
    'critic.use_dynamic_bsz':
        'token-budget micro-batches',
    'critic.ppo_max_token_len_per_gpu':
        'token-budget micro-batches',
    'critic.ppo_epochs':
        "null = the actor's",
    'critic.shuffle':
        "as the actor's",
    'critic.grad_clip':
        "as the actor's",
    'critic.cliprange_value':
        'value clip around the old values',
    'critic.loss_agg_mode':
        "null = the actor's",
    'reward_model.enable':
        'a scalar reward model scores each response (on its last token); as in verl its score is the training'
        ' reward. Rule scoring (custom function or data_source scorer) still runs when every data source has '
        'a scorer or a custom function is set, but only for metrics (`reward/acc/mean`, '
        '`reward/rule_score/mean`), gdpo components and validation (rule-based; skipped when rule scoring is '
        'off). Logs `reward/rm_score/mean`; DAPO overlong shaping is added to the model score',
    'reward_model.model.path':
        'sequence classifier with one label (`AutoModelForSequenceClassification`, `num_labels=1`), local or '
        'hub id; or, with `judge.enable=True`, a causal LM that grades each response (the generative judge)',
    'reward_model.model.input_tokenizer':
        "tokenizer the policy's ids are decoded with before re-encoding in the reward model's chat template "
        "(null = the actor's)",
    'reward_model.model.trust_remote_code':
        "allow the reward model's own modelling / tokenizer code",
    'reward_model.micro_batch_size_per_gpu':
        "rows per reward-model forward on each rank (null = all the rank's rows at once); for the judge, the "
        "prompts decoded together",
    'reward_model.max_length':
        'keep the first this many tokens of the re-encoded exchange (null = all)',
    'reward_model.use_dynamic_bsz':
        'token-budget micro-batches for the reward model',
    'reward_model.forward_max_token_len_per_gpu':
        'token budget of one reward-model micro-batch (with `use_dynamic_bsz`), in padded positions (rows x '
        'longest row)',
    'reward_model.reward_manager':
        '`naive` / `dapo`: the scorer is called per response (`dapo` is the same call; the overlong shaping is '
        '`overlong_buffer.*`); `batch`: called once per step with lists (`data_sources`, `solution_strs`, '
        '`ground_truths`, `extra_infos` keywords), returns a list of scores, time limit `timeout_s` per row; '
        '`prime`: per response, always in worker processes (needs `num_workers` >= 1 or null)',
    'reward_model.launch_reward_fn_async':
        'rejected when True (scoring already runs in worker processes)',
    'reward_model.num_workers':
        'rule-scorer worker processes per training process (null = the CPU cores per process, 2 to 8; '
        '0 = the training process scores, with no time limit, so a hanging scorer hangs the run). A hung, '
        'raising or crashing scorer scores 0 and is counted (`reward/timeouts`, `reward/errors`); its worker is '
        'replaced. The reward model (`enable=True`) runs in the training processes whatever this says',
    'reward_model.timeout_s':
        'per-response scorer time limit in worker processes (seconds)',
    'reward_model.max_error_rate':
        'stop the run when more than this share of a step\'s responses failed to score (raised, timed out, '
        'crashed, or returned NaN/inf/None/a string/a dict without `score`: each scored 0 and counted); '
        '1 never stops',
    'reward_model.sandbox_fusion.url':
        'a SandboxFusion-compatible server (`posttrain sandbox-server`, or SandboxFusion) that runs code rewards; '
        'unset: the local bubblewrap sandbox',
    'reward_model.sandbox_fusion.max_concurrent':
        'requests in flight to the server from one scoring process',
    'reward_model.sandbox_fusion.memory_limit_mb':
        'memory (address space) limit of each program run for code rewards, on the server or locally',
    'reward_model.code_sandbox.run_timeout':
        'wall-time limit of one program run for code rewards, seconds (CPU time: the same, rounded up)',
    'reward_model.code_sandbox.allow_unsandboxed':
        'UNSAFE: where no bubblewrap sandbox can start, run model-written code without isolation instead of '
        'refusing',
    'reward_model.overlong_buffer.enable':
        'DAPO overlong shaping (ALGORITHMS.md)',
    'reward_model.overlong_buffer.len':
        'DAPO overlong shaping (ALGORITHMS.md)',
    'reward_model.overlong_buffer.penalty_factor':
        'DAPO overlong shaping (ALGORITHMS.md)',
    'reward_model.overlong_buffer.log':
        'log the penalty as `reward/overlong_penalty/mean`',
    'reward_model.judge.enable':
        'the reward model (`model.path`, a causal LM) is a generative judge: it answers a prompt filled from '
        '`prompt_template` for each response, and the answer is parsed into a score (`reward/judge_score/mean`). '
        'A verdict that cannot be parsed scores 0 and counts in `reward/errors` (share: '
        '`reward/judge_unparsed/mean`). Placed like the reference (sharded over several processes), decoded by '
        "posttrain's rollout engine; validation stays rule-based",
    'reward_model.judge.prompt_template':
        'the judge\'s prompt, with placeholders `{question}` (the last user message), `{response}`, '
        '`{ground_truth}` (a literal brace is `{{` / `}}`); null = the built-in template, which asks whether the '
        'final answer is correct against the reference and for one word, `correct` or `incorrect`',
    'reward_model.judge.prompt_template_path':
        'a text file holding the template (instead of `prompt_template`)',
    'reward_model.judge.use_chat_template':
        "send the filled template as one user turn in the judge's chat template (False, or a tokenizer without "
        'one: the text as it is)',
    'reward_model.judge.score_regex':
        "parse the verdict with this regular expression: its last match's first group (the whole match without "
        'a group) read as a number, e.g. `[Ss]core: *(-?[0-9.]+)` or `\\[\\[([0-9.]+)\\]\\]`; null = the '
        'default parser: the last whole word `correct` (1) or `incorrect` (0)',
    'reward_model.judge.parse_function.path':
        'python file with a function `parse(text) -> float` (None, an exception or NaN: unparseable); instead of '
        '`score_regex`',
    'reward_model.judge.parse_function.name':
        'the function in `parse_function.path`',
    'reward_model.judge.response_length':
        'most tokens the judge writes per verdict (it stops at its end-of-sequence token)',
    'reward_model.judge.temperature':
        "the judge's sampling temperature; 0 = greedy (the default)",
    'reward_model.judge.top_p':
        "the judge's nucleus sampling (with temperature > 0)",
    'reward_model.judge.top_k':
        "the judge's top-k sampling (with temperature > 0; -1 = off)",
    'reward_model.judge.combine':
        'how the judge score j meets the rule score r: `replace` (the training reward is j; rule scores only feed '
        'metrics, as with the scalar reward model), `add` (r + j), `multiply` (r * j), `gate` (j where r > 0, else '
        'r); all but `replace` need a rule score for every row. DAPO overlong shaping is added afterwards',
    'custom_reward_function.path':
        'python file with the scorer',
    'custom_reward_function.name':
        '`compute_score(data_source, solution_str, ground_truth, extra_info) -> float or dict(score=...)`',
    'algorithm.adv_estimator':
        '`gae`, `grpo`, `rloo`, `reinforce_plus_plus`, `reinforce_plus_plus_baseline`, `remax`, `gpg`, `opo`,'
        ' `grpo_passk`, `optimal_token_baseline`, `gdpo`, `grpo_vectorized` / `rloo_vectorized` (= `grpo` / '
        '`rloo`), or registered',
    'algorithm.gamma':
        'discount and GAE lambda',
    'algorithm.lam':
        'discount and GAE lambda',
    'algorithm.norm_adv_by_std_in_grpo':
        'False = Dr. GRPO',
    'algorithm.use_kl_in_reward':
        '`r = score - beta * kl(old, ref)` (loads the reference)',
    'algorithm.kl_penalty':
        'estimator of the in-reward KL',
    'algorithm.kl_ctrl.type':
        'beta and its controller',
    'algorithm.kl_ctrl.kl_coef':
        'beta and its controller',
    'algorithm.kl_ctrl.horizon':
        'beta and its controller',
    'algorithm.kl_ctrl.target_kl':
        'beta and its controller',
    'algorithm.filter_groups.enable':
        'DAPO dynamic sampling',
    'algorithm.filter_groups.metric':
        "DAPO dynamic sampling: a group is kept when this differs among its responses: `score` / `acc` (the scorer's "
        'own, before overlong shaping), `seq_reward` (summed token-level scores, shaping included), `seq_final_reward` '
        '(summed token-level rewards, the in-reward KL penalty subtracted); see docs/algorithms.md',
    'algorithm.filter_groups.max_num_gen_batches':
        'DAPO dynamic sampling',
    'algorithm.gdpo_reward_keys':
        "`gdpo`: the keys of the reward function's dict, one reward component each (required)",
    'algorithm.gdpo_reward_weights':
        '`gdpo`: a weight per component (null = 1 each)',
    'algorithm.rollout_correction.rollout_is':
        'truncated importance sampling `pi_old / pi_rollout`: `token` or `sequence` (null = off)',
    'algorithm.rollout_correction.rollout_is_threshold':
        'upper truncation of the weights',
    'algorithm.rollout_correction.rollout_rs':
        'rejection sampling: not supported, any value but null is rejected',
    'algorithm.rollout_correction.rollout_rs_threshold':
        'rejection sampling: not supported, any value but null is rejected',
    'algorithm.rollout_correction.bypass_mode':
        "True: the rollout's log-probs are the old policy (no old-log-prob pass); not with `rollout_is`",
    'algorithm.rollout_correction.loss_type':
        "bypass mode's loss: `ppo_clip` (the configured policy loss); `reinforce` is rejected",
    'algorithm.rollout_correction.rollout_is_batch_normalize':
        'rescale the weights to mean 1 over the batch',
    'trainer.project_name':
        'name the run folder `checkpoints/{project_name}/{experiment_name}`',
    'trainer.experiment_name':
        'name the run folder `checkpoints/{project_name}/{experiment_name}`',
    'trainer.logger':
        'any of `console`, `jsonl`, `tensorboard`, `wandb`, `mlflow` (the last two need the `tracking` '
        'extra); the JSONL metrics file is always written',
    'trainer.total_epochs':
        'passes over the training prompts',
    'trainer.total_training_steps':
        'stop after this many steps (overrides epochs; >= 1, or null for trainer.total_epochs)',
    'trainer.nnodes':
        'processes of the job; `posttrain train` starts the `n_gpus_per_node` processes of one node itself '
        '(on a CPU machine: gloo processes); with `nnodes > 1` start it under torchrun on each node '
        "(docs/scaling.md). Under torchrun left at 1 / 1 they take torchrun's layout",
    'trainer.n_gpus_per_node':
        'processes of the job; `posttrain train` starts the `n_gpus_per_node` processes of one node itself '
        '(on a CPU machine: gloo processes); with `nnodes > 1` start it under torchrun on each node '
        "(docs/scaling.md). Under torchrun left at 1 / 1 they take torchrun's layout",
    'trainer.device':
        '`auto` (cuda if available), `cpu`, `cuda`',
    'trainer.seed':
        'seed of sampling and initialisation',
    'trainer.save_freq':
        'checkpoint every N steps (and at the end when > 0)',
    'trainer.test_freq':
        'validate every N steps (and at the end when > 0)',
    'trainer.val_before_train':
        'validate before the first step',
    'trainer.val_only':
        'validate the starting weights (or the checkpoint a run resumes from) and stop; needs '
        '`data.val_files`',
    'trainer.max_nonfinite_updates_in_a_row':
        'an optimizer update whose loss or gradient norm is NaN/inf is skipped and counted; the run stops after '
        'this many skipped updates in a row, naming the quantity that went non-finite first (0 = never stop)',
    'trainer.critic_warmup':
        'steps that update only the critic',
    'trainer.balance_batch':
        'with several processes, give each rank whole prompt groups with near-equal token counts (else '
        'consecutive groups)',
    'trainer.default_local_dir':
        'run folder; null = `checkpoints/{project_name}/{experiment_name}`',
    'trainer.resume_mode':
        '`auto` (the newest checkpoint of the run folder that loads), `disable` (start over), `resume_path`',
    'trainer.resume_from_path':
        'checkpoint folder for `resume_path`',
    'trainer.overwrite_run_dir':
        'with `resume_mode=disable`, delete the checkpoints and metrics of a run already in the run folder and '
        'start over (otherwise that is refused)',
    'trainer.resume_allow_config_change':
        'resume although the config differs from the run\'s saved `config.yaml` in keys other than run length, '
        'logging, validation and checkpoint keeping (otherwise refused, naming the keys)',
    'trainer.max_actor_ckpt_to_keep':
        'keep only the newest N checkpoints (a checkpoint holds both roles; the smaller N wins)',
    'trainer.max_critic_ckpt_to_keep':
        'keep only the newest N checkpoints (a checkpoint holds both roles; the smaller N wins)',
    'trainer.log_val_generations':
        'validation samples printed and logged per validation',
    'trainer.rollout_data_dir':
        'dump generations (JSONL) per step / per validation',
    'trainer.validation_data_dir':
        'dump generations (JSONL) per step / per validation',
}


def _match(pattern: list[str], key: list[str]) -> list[str] | None:
    """Segments captured by `*` (in order), or None when the key does not match."""
    if not pattern:
        return [] if not key else None
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        for i in range(len(key) + 1):
            tail = _match(rest, key[i:])
            if tail is not None:
                return tail
        return None
    if not key or (head != "*" and head != key[0]):
        return None
    tail = _match(rest, key[1:])
    if tail is None:
        return None
    return ([key[0]] if head == "*" else []) + tail


def find_rule(key: str) -> tuple[Rule, list[str]] | None:
    """The first rule matching a dotted key that posttrain's schema does not have, with its `*` captures."""
    parts = key.split(".")
    for rule in RULES:
        captured = _match(rule.pattern.split("."), parts)
        if captured is not None:
            return rule, captured
    return None


def allowed(rule: Rule, value: Any) -> bool:
    """Whether an `only` rule accepts the value ('False', 'null' and 1.0 compare as False, None and 1)."""
    def norm(v):
        if isinstance(v, str) and v.lower() in ("none", "null", "~", ""):
            return None
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        if isinstance(v, (list, tuple)):
            return tuple(norm(x) for x in v)
        if isinstance(v, dict) and not v:
            return None
        return v
    return any(norm(value) == norm(a) for a in rule.allowed)


def describe(rule: Rule, captured: list[str]) -> str:
    if rule.kind == "map":
        return f"-> `{rule.target.format(*captured)}`: {rule.why}"
    if rule.kind == "only":
        values = ", ".join("null" if a is None else str(a) for a in rule.allowed)
        return f"accepted when {values}; otherwise rejected: {rule.why}"
    return f"accepted, no effect: {rule.why}"


# ------------------------------------------------------------------ docs/config.md


def render(familiar_keys: list[str], intro: str) -> str:
    """docs/config.md: the intro, posttrain's keys by section, then every other familiar key and its decision."""
    from .loader import all_keys, default_of

    out = [intro.rstrip(), ""]
    section = None
    for key in all_keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            out += ["", f"## {top}", "", "| key | default | what it does |", "|---|---|---|"]
        default = default_of(key)
        shown = "null" if default is None else default
        out.append(f"| `{key[len(top) + 1:]}` | {shown} | {DESCRIPTIONS[key]} |")
    ours = set(all_keys())
    others = sorted(k for k in set(familiar_keys) if k not in ours)
    out += ["", "## Keys posttrain does not act on", "",
            "Every other key of the familiar schema, and what posttrain does when a command line sets it.", "",
            "| key | decision |", "|---|---|"]
    mappings = [k for k in ours if isinstance(default_of(k), dict)]
    for key in others:
        found = find_rule(key)
        field = next((m for m in mappings if key.startswith(m + ".")), None)
        decision = (describe(*found) if found else
                    f"an entry of `{field}`, which posttrain acts on" if field else "unknown")
        out.append(f"| `{key}` | {decision} |")
    return "\n".join(out) + "\n"


INTRO_END = "<!-- everything below is generated: python -m posttrain.config.keytable -->"


def main() -> None:
    """Regenerate docs/config.md below its marker line."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    doc = root / "docs" / "config.md"
    intro = doc.read_text().split(INTRO_END)[0] + INTRO_END
    keys = (root / "docs" / "familiar_keys.txt").read_text().split()
    doc.write_text(render(keys, intro))


if __name__ == "__main__":
    main()
