"""The decisions about other systems' keys: what posttrain does with each key of the familiar key tree that is not
one of its own (schema/).

Every such key of the familiar schema (its `ppo_trainer` and `ppo_megatron_trainer` trees) matches a RULE, first
match wins:
  note   accepted; the value has no effect here, and the note says what posttrain does instead (printed once);
  only   accepted when the value is one of `allowed` (what posttrain does anyway); any other value is rejected
         with the reason;
  map    the value is set on posttrain's key `target` (`{0}`, `{1}` = the segments matched by `*`);
  choose each allowed value stands for settings of posttrain's keys (`sets`: value -> `key=value` overrides, applied
         in its place); any other value is rejected with the reason.
The loader applies the rules; docs/config.md lists every familiar key with its decision (docpage.py); a test fails
when a key of the familiar schema matches no rule.
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
    sets: tuple = ()  # choose: ((value, ("key=value", ...)), ...)


ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")
ACTOR_REF = ROLES[:2]
TRAINED = ("actor_rollout_ref.actor", "critic")
NOT_RAY = "posttrain starts its own processes (torch.distributed) and does not use Ray"
ENGINE = ("a knob of the vLLM/SGLang engines that posttrain does not pass on (rollout.name=vllm takes the keys "
          "docs/rollout_engines.md lists); posttrain's own engine sizes its cache per call")
WEIGHTS_IN_PLACE = ("posttrain's engine reads the training weights in place (no weight transfer); rollout.name=vllm "
                    "loads them into vLLM by name, bucket by bucket (rollout.update_weights_bucket_megabytes)")
PROFILER = ("posttrain has no profiler hook; run py-spy or torch.profiler around `posttrain train` "
            "(docs/performance.md shows how)")
MEGATRON_ROLE = "every role uses the actor's layout (its megatron.* sizes)"
MEGATRON_LAYOUT = ("Megatron's virtual pipeline stages and expert parallel have no equivalent here: FSDP2 shards the "
                   "model, experts included (tensor parallel maps onto actor.fsdp_config.tp_size, pipeline onto "
                   "actor.row_replicas, context onto Ulysses sequence parallel)")
DIST_CKPT = ("a Megatron checkpoint converted from the Hugging Face weights, for faster loading; posttrain reads the "
             "Hugging Face weights at model.path")
ENVIRONMENTS = ("custom agent loop and interaction classes are not loaded: write the turn logic as an environment "
                "(posttrain.agents.register_environment, docs/agents.md) and name it in a row's agent_name or "
                "actor_rollout_ref.rollout.agent.default_agent_loop")
OWN_ENGINE = "posttrain's engine serves the episodes in the training processes; no separate server or manager"
ROLLOUT_SERVER = ("a setting of the client of verl's rollout server (request time limit, retries and their delay, "
                  "connection pool, start-up wait); posttrain's engine decodes the episodes in the training "
                  "processes, so no server starts and no generation request is sent, pooled, retried or timed out: "
                  "what is generated does not depend on it. Refused with rollout.agent.program, whose requests go "
                  "to the policy's server (its limits: rollout.agent.num_workers and program_timeout_s)")
VL = "vision-language rows are read as the model's own image processor decides (images only, no video)"
NO_SP = ("another engine's sequence-parallel key; posttrain's is actor_rollout_ref.actor."
         "ulysses_sequence_parallel_size (Ulysses, FSDP2)")
TRANSFORMERS = "posttrain computes log-probs and entropy in chunks on the transformers model itself"
REF_ROUTES = ("router replay is the actor's (actor_rollout_ref.actor.router_replay.mode); the reference routes each "
              "token itself")
REPLAY_IN_MEMORY = "router replay's records travel with the batch in memory (no files)"


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
    Rule("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", "map", "Megatron's pipeline ranks hold "
         "the same rows and shard the model (no pipelining here), so the data-parallel size stays Megatron's",
         target="actor_rollout_ref.actor.row_replicas"),
    *_roles("megatron.pipeline_model_parallel_size", "note", MEGATRON_ROLE, roles=ROLES[1:]),
    *_roles("megatron.virtual_pipeline_model_parallel_size", "note", MEGATRON_LAYOUT),
    Rule("actor_rollout_ref.actor.megatron.context_parallel_size", "map", "context parallel splits each sequence "
         "over ranks, as Ulysses sequence parallel does (with tensor parallel, which Ulysses does not run beside, "
         "its ranks hold the same rows instead: a note says so)",
         target="actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    *_roles("megatron.context_parallel_size", "note", MEGATRON_ROLE, roles=ROLES[1:]),
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
    # the newest tree's place for the sequence-parallel size (the role's own key is deprecated there)
    Rule("actor_rollout_ref.*.fsdp_config.ulysses_sequence_parallel_size", "map", "the role's sequence-parallel size",
         target="actor_rollout_ref.{0}.ulysses_sequence_parallel_size"),
    Rule("critic.model.fsdp_config.ulysses_sequence_parallel_size", "map", "the critic's sequence-parallel size",
         target="critic.ulysses_sequence_parallel_size"),
    Rule("**.fsdp_config.ulysses_sequence_parallel_size", "only", "set the role's ulysses_sequence_parallel_size "
         "(actor_rollout_ref.actor.ulysses_sequence_parallel_size holds the layout)", (1,)),

    # ---- actor / ref / critic
    *_roles("entropy_checkpointing", "note", TRANSFORMERS, roles=ACTOR_REF),
    *_roles("entropy_from_logits_with_chunking", "note", TRANSFORMERS, roles=ACTOR_REF),
    *[Rule(f"actor_rollout_ref.{role}.use_torch_compile", "map", "torch.compile of each decoder layer",
           target=f"actor_rollout_ref.{role}.fsdp_config.use_torch_compile") for role in ("actor", "ref")],
    *_roles("rollout_n", "note", "always actor_rollout_ref.rollout.n", roles=ROLES[:3]),
    Rule("actor_rollout_ref.ref.router_replay.mode", "only", REF_ROUTES, ("disabled",)),
    *_roles("router_replay.record_file", "only", REPLAY_IN_MEMORY, (None,), roles=ACTOR_REF),
    *_roles("router_replay.replay_file", "only", REPLAY_IN_MEMORY, (None,), roles=ACTOR_REF),
    Rule("reward_model.ulysses_sequence_parallel_size", "note", "the reward model computes whole rows on each "
         "rank"),
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
    Rule("actor_rollout_ref.actor.use_remove_padding", "note", "follows actor_rollout_ref.model.use_remove_padding"),
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
    Rule("actor_rollout_ref.model.lora.adapter_path", "map", "a saved adapter to continue from",
         target="actor_rollout_ref.model.lora_adapter_path"),
    Rule("actor_rollout_ref.model.lora.dropout", "only", "posttrain's LoRA has no dropout", (0, 0.0)),
    Rule("actor_rollout_ref.model.lora.merge", "note", "posttrain merges LoRA into the decoding weights each step"),
    Rule("actor_rollout_ref.model.lora.target_modules", "note", "Megatron module names; posttrain adapts "
         "actor_rollout_ref.model.target_modules (default all-linear)"),
    Rule("actor_rollout_ref.model.lora.exclude_modules", "map", "modules LoRA leaves out",
         target="actor_rollout_ref.model.exclude_modules"),
    Rule("actor_rollout_ref.model.lora.**", "note", "Megatron LoRA details; posttrain's LoRA is peft's, applied "
         "to the language model"),
    Rule("critic.model.lora.rank", "only", "the critic trains all its weights (no LoRA critic)", (0,)),
    Rule("critic.model.lora.**", "note", "the critic trains all its weights (no LoRA critic)"),
    Rule("critic.model.lora_rank", "only", "the critic trains all its weights (no LoRA critic)", (0,)),
    Rule("critic.model.lora_alpha", "note", "the critic trains all its weights (no LoRA critic)"),
    Rule("critic.model.target_modules", "note", "the critic trains all its weights (no LoRA critic)"),
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
    Rule("actor_rollout_ref.rollout.multi_turn.interaction_config_path", "only", ENVIRONMENTS, (None,)),
    Rule("actor_rollout_ref.rollout.multi_turn.completion_callback", "only", ENVIRONMENTS, (None,)),
    Rule("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "note", "each prompt's episodes are its "
         "rollout.n samples"),
    Rule("actor_rollout_ref.rollout.agent.agent_loop_manager_class", "only", OWN_ENGINE, (None,)),
    Rule("actor_rollout_ref.rollout.agent.custom_async_server.*", "only", OWN_ENGINE, (None,)),
    Rule("actor_rollout_ref.rollout.engine_kwargs.**", "note", ENGINE),
    Rule("actor_rollout_ref.rollout.engine_kwargs", "note", ENGINE),
    Rule("actor_rollout_ref.rollout.checkpoint_engine.**", "note", WEIGHTS_IN_PLACE),
    Rule("actor_rollout_ref.rollout.prometheus.enable", "only", "no metrics server; metrics go to trainer.logger",
         (False,)),
    Rule("actor_rollout_ref.rollout.prometheus.**", "note", "no metrics server; metrics go to trainer.logger"),
    Rule("actor_rollout_ref.rollout.trace.**", "note", "no rollout tracing; trainer.rollout_data_dir dumps the "
         "generations"),
    Rule("actor_rollout_ref.rollout.layer_name_map.**", "note", WEIGHTS_IN_PLACE),
    *[Rule(f"actor_rollout_ref.rollout.{k}", "note", ENGINE)
      for k in ("cudagraph_capture_sizes", "data_parallel_size", "disable_log_stats", "enable_prefix_caching",
                "layered_summon", "multi_stage_wake_up", "scheduling_policy", "skip_tokenizer_init",
                "expert_parallel_size", "pipeline_model_parallel_size", "skip_dump_dir")],
    Rule("actor_rollout_ref.ref.model", "only", "the reference is the actor's starting model", (None,)),
    Rule("actor_rollout_ref.rollout.logprobs_mode", "note", "the sampled tokens' log-probs are those of the "
         "processed (temperature, top-k, top-p) distribution"),
    Rule("actor_rollout_ref.rollout.quantization", "only", "posttrain's engine decodes in model.dtype / rollout.dtype; "
         "quantized decoding is not supported", (None,)),
    Rule("actor_rollout_ref.rollout.quantization_config_file", "only", "quantized decoding is not supported",
         (None,)),
    Rule("actor_rollout_ref.rollout.over_sample_rate", "note", "every sample runs to its end: the slowest are "
         "not cut short, and each prompt keeps its rollout.n samples"),
    Rule("actor_rollout_ref.rollout.skip_rollout", "only", "rollouts are always generated", (False,)),
    Rule("actor_rollout_ref.rollout.mtp", "only", "multi-token prediction is not supported", (None,)),
    # the client side of verl's rollout server (a separate engine process the agent loops send HTTP requests to)
    *[Rule(f"actor_rollout_ref.rollout.server.{k}", "note", ROLLOUT_SERVER)
      for k in ("timeout", "max_attempts", "retry_delay", "max_connections", "max_start_wait_time")],
    Rule("actor_rollout_ref.rollout.sglang_rollout_mode", "only", "SGLang's engine inside the training process "
         "(`engine`) or behind its HTTP server (`server`) decodes the same samples; posttrain's engine decodes in the "
         "training processes", ("engine", "server")),

    # ---- data
    Rule("data.datagen.*", "only", "dynamic data generation is not supported", (None,)),
    Rule("data.gen_batch_size", "note", "a step's prompts are generated together (DAPO's refills draw "
         "data.train_batch_size prompts each)"),
    Rule("data.dataloader_num_workers", "note", "rows are tokenized once at start-up; no loader workers"),
    Rule("data.filter_overlong_prompts_workers", "note", "rows are tokenized once at start-up in the main process"),
    Rule("data.image_patch_size", "note", VL),
    Rule("data.video_key", "note", VL),
    Rule("data.return_multi_modal_inputs", "note", VL),
    Rule("data.return_full_prompt", "note", "scorers receive the raw chat with data.return_raw_chat"),
    Rule("data.return_raw_input_ids", "note", "the reward model reads its own tokenization"),
    Rule("data.tokenizer", "only", "prompts are tokenized with the actor's tokenizer", (None,)),
    *[Rule(f"data.{k}", "note", "prompts are encoded with the schemas of the tools of "
           f"actor_rollout_ref.rollout.multi_turn.{k} (from which this key takes its value in the familiar tree)")
      for k in ("tool_config_path", "function_tool_path")],
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
    Rule("reward_manager.source", "only", "reward_model.reward_manager names the manager", ("register",)),
    Rule("reward_manager.module.path", "only", "use custom_reward_function.path", (None,)),
    Rule("reward_manager.name", "note", "reward_model.reward_manager names the manager"),
    Rule("reward_manager.module.name", "note", "reward_model.reward_manager names the manager"),

    # ---- algorithm
    Rule("algorithm.use_pf_ppo", "only", "PF-PPO (reweighting samples by reward) is not supported", (False,)),
    Rule("algorithm.pf_ppo.*", "note", "PF-PPO is not supported"),


    Rule("algorithm.rollout_correction.use_policy_gradient", "choose", "verl's former spelling of "
         "rollout_correction.loss_type: True = reinforce (REINFORCE with explicit weights in bypass mode)",
         sets=((False, ()), (True, ("algorithm.rollout_correction.loss_type=reinforce",)))),
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


# ---- the newest tree (verl's August 2026 snapshot): engine families, the top-level reward block, new engine keys
ENGINE_FAMILY = ("the training engine family: `dp` and `veomni` are FSDP2-sharded engines (posttrain's FSDP2); "
                 "`megatron` is read as strategy=megatron, whose layout maps onto FSDP2 x tensor parallel")
MEGATRON_ENGINE = ("actor_rollout_ref.actor.strategy=megatron", "critic.strategy=megatron")
NO_EP = ("expert parallel has no equivalent here: expert weights are sharded with FSDP2 like the others (tensor "
         "parallel maps onto actor.fsdp_config.tp_size)")
KERNEL = "a kernel choice of that engine; posttrain runs the transformers model's own implementation"
WRAP_PLAN = "which modules the engine wraps; posttrain's FSDP2 shards each decoder layer, then the root"
OWN_REWARD = "the top-level reward block of the newest tree, read as posttrain's reward keys"
NEWEST_TREE: list[Rule] = [
    Rule("model_engine", "choose", ENGINE_FAMILY,
         sets=(("dp", ()), ("veomni", ()), ("megatron", MEGATRON_ENGINE))),
    Rule("actor_rollout_ref.actor.model_engine", "choose", ENGINE_FAMILY,
         sets=(("dp", ()), ("veomni", ()), ("megatron", MEGATRON_ENGINE))),
    # veomni (an FSDP2 engine with expert and sequence parallel)
    Rule("actor_rollout_ref.*.veomni.param_offload", "map", "keep weights in CPU memory",
         target="actor_rollout_ref.{0}.fsdp_config.param_offload"),
    Rule("actor_rollout_ref.actor.veomni.enable_fsdp_offload", "map", "keep weights in CPU memory",
         target="actor_rollout_ref.actor.fsdp_config.param_offload"),
    Rule("actor_rollout_ref.actor.veomni.optimizer_offload", "map", "keep Adam state in CPU memory",
         target="actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
    Rule("actor_rollout_ref.*.veomni.fsdp_size", "map", "the FSDP2 shard group size",
         target="actor_rollout_ref.{0}.fsdp_config.fsdp_size"),
    Rule("actor_rollout_ref.*.veomni.enable_full_shard", "map", "full sharding = FSDP2 freeing the gathered "
         "weights after the forward (False: kept until the backward)",
         target="actor_rollout_ref.{0}.fsdp_config.reshard_after_forward"),
    Rule("actor_rollout_ref.*.veomni.expert_parallel_size", "note", NO_EP),
    Rule("actor_rollout_ref.*.veomni.ulysses_parallel_size", "note", NO_SP),
    *[Rule(f"actor_rollout_ref.*.veomni.{k}_implementation", "note", KERNEL)
      for k in ("attn", "moe", "cross_entropy_loss", "dsa_attention", "dsa_indexer", "mhc")],
    *[Rule(f"actor_rollout_ref.actor.{engine}.router_replay.mode", "map", f"{engine}'s router replay",
           target="actor_rollout_ref.actor.router_replay.mode") for engine in ("veomni", "megatron")],
    Rule("actor_rollout_ref.actor.pad_to_length", "note", "posttrain cuts each micro-batch to its longest row"),
    # fsdp_turbo (FSDP2 with its own wrap and recompute plans)
    Rule("actor_rollout_ref.*.fsdp_config.turbo_config.distributed.fully_shard_parallel_size", "map",
         "the FSDP2 shard group size", target="actor_rollout_ref.{0}.fsdp_config.fsdp_size"),
    Rule("actor_rollout_ref.*.fsdp_config.turbo_config.distributed.ulysses_parallel_size", "note", NO_SP),
    Rule("actor_rollout_ref.*.fsdp_config.turbo_config.distributed.expert_parallel_size", "note", NO_EP),
    Rule("actor_rollout_ref.*.fsdp_config.turbo_config.distributed.fsdp_plan.*", "note", WRAP_PLAN),
    Rule("actor_rollout_ref.*.fsdp_config.turbo_config.distributed.ep_plan.*", "note", NO_EP),
    Rule("actor_rollout_ref.actor.fsdp_config.turbo_config.memory.recompute", "map", "activation recomputation",
         target="actor_rollout_ref.model.enable_gradient_checkpointing"),
    Rule("actor_rollout_ref.ref.fsdp_config.turbo_config.memory.recompute", "note", "the reference computes "
         "log-probs without gradients, so it keeps no activations to recompute"),
    Rule("actor_rollout_ref.*.fsdp_config.turbo_config.memory.recompute_plan", "note", "which layers recompute; "
         "posttrain checkpoints every decoder layer (model.enable_gradient_checkpointing)"),
    # Megatron additions
    *_roles("megatron.use_megatron_fsdp", "note", "Megatron's own FSDP: posttrain shards with FSDP2 always",
            roles=ACTOR_REF),
    Rule("actor_rollout_ref.rollout.moe_tensor_parallel_size", "note", ENGINE),
    Rule("actor_rollout_ref.actor.checkpoint.strict", "note", "a resumed checkpoint must match the model; posttrain "
         "loads it strictly always"),
    # the critic's engine section
    Rule("critic.fsdp.*", "map", "the critic's FSDP settings", target="critic.model.fsdp_config.{0}"),
    # SAPO's temperatures under policy_loss
    *[Rule(f"actor_rollout_ref.actor.policy_loss.{k}", "map", "SAPO's gate temperatures",
           target=f"actor_rollout_ref.actor.{k}") for k in ("tau_pos", "tau_neg")],
    # the top-level reward block
    Rule("reward.custom_reward_function.*", "map", OWN_REWARD, target="custom_reward_function.{0}"),
    Rule("reward.reward_manager.name", "map", OWN_REWARD, target="reward_model.reward_manager"),
    Rule("reward.reward_manager.source", "map", OWN_REWARD, target="reward_manager.source"),
    Rule("reward.reward_manager.module.*", "map", OWN_REWARD, target="reward_manager.module.{0}"),
    Rule("reward.reward_kwargs.overlong_buffer_cfg.*", "map", OWN_REWARD, target="reward_model.overlong_buffer.{0}"),
    Rule("reward.reward_kwargs.max_resp_len", "note", "the overlong shaping uses data.max_response_length"),
    Rule("reward.num_workers", "map", OWN_REWARD, target="reward_model.num_workers"),
    Rule("reward.sandbox_fusion.*", "map", OWN_REWARD, target="reward_model.sandbox_fusion.{0}"),
    Rule("reward.reward_model.model_path", "map", OWN_REWARD, target="reward_model.model.path"),
    Rule("reward.reward_model.rollout.**", "note", "the reward model runs in the training processes"),
    Rule("reward.reward_model.*", "map", OWN_REWARD, target="reward_model.{0}"),
    # the Megatron-lite engine: a Hydra config group of another package
    Rule("actor@actor_rollout_ref.actor", "choose", "a Hydra config-group choice of the actor's engine: "
         "`dp_actor` is FSDP2; `megatron_actor` and `mlite_actor` (Megatron-lite: tensor/pipeline/context/expert "
         "parallel, its engine.* keys) are read as strategy=megatron, whose layout maps onto FSDP2 x tensor parallel",
         sets=(("dp_actor", ()), ("megatron_actor", MEGATRON_ENGINE[:1]), ("mlite_actor", MEGATRON_ENGINE[:1]))),
    Rule("hydra.searchpath", "note", "Hydra's own settings; there is no Hydra here"),
    Rule("actor_rollout_ref.actor.engine.tp", "map", "the engine's tensor parallel = posttrain's tensor parallel",
         target="actor_rollout_ref.actor.fsdp_config.tp_size"),
    Rule("actor_rollout_ref.actor.engine.pp", "map", "pipeline ranks hold the same rows and shard the model",
         target="actor_rollout_ref.actor.row_replicas"),
    Rule("actor_rollout_ref.actor.engine.cp", "map", "context parallel = Ulysses sequence parallel",
         target="actor_rollout_ref.actor.ulysses_sequence_parallel_size"),
    *[Rule(f"actor_rollout_ref.actor.engine.{k}", "note", MEGATRON_LAYOUT) for k in ("vpp", "ep", "etp")],
    Rule("actor_rollout_ref.actor.engine.param_offload", "map", "keep weights in CPU memory",
         target="actor_rollout_ref.actor.fsdp_config.param_offload"),
    Rule("actor_rollout_ref.actor.engine.optimizer_offload", "map", "keep Adam state in CPU memory",
         target="actor_rollout_ref.actor.fsdp_config.optimizer_offload"),
    Rule("actor_rollout_ref.actor.engine.grad_offload", "note", "gradients follow fsdp_config.param_offload"),
    Rule("actor_rollout_ref.actor.engine.attention_backend_override", "note", KERNEL),
    Rule("actor_rollout_ref.actor.engine.impl_cfg.**", "note", "the engine's own kernel, optimizer and recompute "
         "settings; posttrain runs the transformers model with torch AdamW"),
]
RULES += NEWEST_TREE


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


def choice(rule: Rule, value: Any) -> tuple | None:
    """The overrides a `choose` rule's value stands for; None when the value is not one of its choices."""
    return next((sets for v, sets in rule.sets if allowed(Rule("", "only", allowed=(v,)), value)), None)


def describe(rule: Rule, captured: list[str]) -> str:
    if rule.kind == "choose":
        values = "; ".join(f"{v}: {', '.join(f'`{x}`' for x in sets) or 'no key changes'}" for v, sets in rule.sets)
        return f"{values}; otherwise rejected: {rule.why}"
    if rule.kind == "map":
        return f"-> `{rule.target.format(*captured)}`: {rule.why}"
    if rule.kind == "only":
        values = ", ".join("null" if a is None else str(a) for a in rule.allowed)
        return f"accepted when {values}; otherwise rejected: {rule.why}"
    return f"accepted, no effect: {rule.why}"
