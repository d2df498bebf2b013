"""The config key tree users already type, as typed dataclasses with the customary defaults (CONFIG_KEYS.md).

Every field here is read somewhere; docs/config.md says what each does. Keys that exist on those command lines but
that posttrain does not support are not fields: they are listed in `validate.UNSUPPORTED_KEYS` with what to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

StrOrList = Union[str, list]


# ------------------------------------------------------------------ data
@dataclass
class DataConfig:
    train_files: Optional[StrOrList] = None
    val_files: Optional[StrOrList] = None
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: Optional[int] = None
    shuffle: bool = True
    seed: int = 1
    filter_overlong_prompts: bool = False
    truncation: str = "error"
    return_raw_chat: bool = False
    image_key: str = "images"
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    train_max_samples: int = -1
    val_max_samples: int = -1
    missing_chat_template: str = "error"


# ------------------------------------------------------------------ actor / rollout / ref
@dataclass
class ModelConfig:
    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    use_remove_padding: bool = True
    enable_gradient_checkpointing: bool = True
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    override_config: dict = field(default_factory=dict)
    dtype: str = "auto"


@dataclass
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    warmup_style: Optional[str] = None
    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    total_training_steps: int = -1


@dataclass
class MixedPrecisionConfig:
    param_dtype: Optional[str] = None  # compute dtype of a sharded model; null = actor_rollout_ref.model.dtype
    reduce_dtype: str = "fp32"  # gradient reduction dtype
    buffer_dtype: str = "fp32"  # accepted for portability; buffers keep the model's dtype


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    fsdp_size: int = -1
    tp_size: int = 1  # tensor-parallel degree (read from actor.fsdp_config; ref / critic follow it)
    model_dtype: str = "fp32"  # dtype of the stored (sharded) weights
    reshard_after_forward: bool = True
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: share of tokens whose gradient is dropped
    clip_cov_lb: float = 1.0  # clip_cov: covariance window (lb, ub) of the candidates
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: share of tokens (largest covariance) that get the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that |log-ratio| penalty


@dataclass
class CheckpointConfig:
    save_contents: list = field(default_factory=lambda: ["model", "optimizer", "extra"])
    load_contents: Optional[list] = None


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0  # sapo: gate temperature for positive advantages
    tau_neg: float = 1.05  # sapo: gate temperature for negative advantages
    calculate_sum_pi_squared: bool = False  # accepted for portability; computed whenever the estimator reads it
    freeze_vision_tower: bool = False  # vision-language models: the vision encoder's weights stay as loaded
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(param_offload=False))


@dataclass
class ValKwargsConfig:
    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class RolloutConfig:
    name: str = "posttrain"  # posttrain's decoding engine; hf = transformers' generate; vllm / sglang -> posttrain
    mode: str = "sync"
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    response_length: Optional[int] = None
    prompt_length: Optional[int] = None
    dtype: str = "auto"
    ignore_eos: bool = False
    calculate_log_probs: bool = False
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    micro_batch_size: Optional[int] = None  # prompts generated together; null = the whole batch
    # Engine-only knobs of vLLM / SGLang: accepted so scripts port, no effect with the hf engine (one warning).
    tensor_model_parallel_size: int = 2
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False
    free_cache_engine: bool = True
    load_format: str = "auto"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    enable_chunked_prefill: bool = True
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


# ------------------------------------------------------------------ critic
@dataclass
class CriticModelConfig:
    path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    use_remove_padding: bool = True
    enable_gradient_checkpointing: bool = True
    override_config: dict = field(default_factory=dict)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None
    strategy: str = "fsdp"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    ppo_epochs: Optional[int] = None
    shuffle: bool = False
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: Optional[str] = None


# ------------------------------------------------------------------ reward
@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None
    input_tokenizer: Optional[str] = None
    trust_remote_code: bool = False


@dataclass
class SandboxFusionConfig:
    url: Optional[str] = None
    max_concurrent: int = 64
    memory_limit_mb: int = 1024


@dataclass
class CodeSandboxConfig:
    run_timeout: float = 5.0
    allow_unsandboxed: bool = False


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False


@dataclass
class JudgeParseFunctionConfig:
    path: Optional[str] = None
    name: str = "parse"


@dataclass
class JudgeConfig:
    enable: bool = False  # reward_model.model.path is a causal LM that grades each response in words
    prompt_template: Optional[str] = None  # {question} {response} {ground_truth}; null = the built-in template
    prompt_template_path: Optional[str] = None
    use_chat_template: bool = True
    score_regex: Optional[str] = None
    parse_function: JudgeParseFunctionConfig = field(default_factory=JudgeParseFunctionConfig)
    response_length: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    combine: str = "replace"


@dataclass
class RewardModelConfig:
    enable: bool = False
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None
    max_length: Optional[int] = None
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int = 32768
    reward_manager: str = "naive"
    launch_reward_fn_async: bool = False
    num_workers: Optional[int] = None  # scorer worker processes; null = from the CPU cores; 0 = in the main process
    timeout_s: float = 10.0  # per-response scorer time limit (worker processes only)
    max_error_rate: float = 0.5  # stop when more of a step's responses than this fail to score
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    code_sandbox: CodeSandboxConfig = field(default_factory=CodeSandboxConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    name: str = "compute_score"


# ------------------------------------------------------------------ algorithm
@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    metric: Optional[str] = None
    max_num_gen_batches: int = 0


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None  # null (off), token or sequence: truncated IS weights pi_old / pi_rollout
    rollout_is_threshold: float = 2.0  # upper truncation of the weights
    rollout_rs: Optional[str] = None  # rejection sampling: not supported (rejected by validate)
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False  # True: the rollout's log-probs are the old policy (no old-log-prob pass)
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip (the configured policy loss)
    rollout_is_batch_normalize: bool = False  # rescale the weights to mean 1 over the batch


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    gdpo_reward_keys: Optional[list] = None  # gdpo: the reward function's dict keys, one component each
    gdpo_reward_weights: Optional[list] = None  # gdpo: a weight per component (null = all 1)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


# ------------------------------------------------------------------ trainer
@dataclass
class TrainerConfig:
    project_name: str = "posttrain"
    experiment_name: str = "run"
    logger: StrOrList = field(default_factory=lambda: ["console"])
    total_epochs: int = 1
    total_training_steps: Optional[int] = None
    nnodes: int = 1
    n_gpus_per_node: int = 1
    device: str = "auto"
    seed: int = 1
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = True
    val_only: bool = False
    critic_warmup: int = 0
    balance_batch: bool = True
    default_local_dir: Optional[str] = None
    resume_mode: str = "auto"
    resume_from_path: Optional[str] = None
    overwrite_run_dir: bool = False
    resume_allow_config_change: bool = False
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None
    log_val_generations: int = 0
    rollout_data_dir: Optional[str] = None
    validation_data_dir: Optional[str] = None
    max_nonfinite_updates_in_a_row: int = 5


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
