"""`actor_rollout_ref.*`: the policy model, its training (actor), the frozen reference and generation (rollout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Hugging Face causal LM: a local directory or a hub id (`owner/name`, see above)"""
    tokenizer_path: Optional[str] = None
    """tokenizer directory or hub id, if not the model's"""
    trust_remote_code: bool = False
    """passed to `from_pretrained`"""
    use_remove_padding: bool = True
    """padding-free micro-batches for the actor and the reference: a micro-batch's rows run as one row of their real
    tokens, attention kept inside each row (sdpa per row on a CPU, Flash's varlen kernel on a GPU in bf16/fp16), and
    a token budget (`ppo_max_token_len_per_gpu`, `log_prob_max_token_len_per_gpu`) counts real tokens. Log-probs,
    entropies and gradients are the padded forward's; prompts are still computed once for their responses (packed
    too). A model that fails a one-time check against the padded forward (sliding-window or non-sdpa attention, a
    vision-language model) runs on padded rows, with a warning. False: padded rows, cut to the longest prompt and
    the longest response of each micro-batch. The critic has its own `critic.model.use_remove_padding`"""
    enable_gradient_checkpointing: bool = True
    """activation checkpointing in the actor (and critic) forward"""
    lora_rank: int = 0
    """> 0 trains a LoRA adapter of this rank (peft) instead of all weights; the reference is then the same model
    with the adapter off"""
    lora_alpha: int = 16
    """LoRA scale and the modules it adapts (`all-linear`, a comma-separated string or a list of names)"""
    target_modules: Any = "all-linear"
    """LoRA scale and the modules it adapts (`all-linear`, a comma-separated string or a list of names)"""
    lora_adapter_path: Optional[str] = None
    """a saved LoRA adapter (a peft folder: adapter_config.json and its weights) to continue training from; its rank,
    scale and modules replace `lora_rank` / `lora_alpha` / `target_modules` (as `PeftModel.from_pretrained` reads it)"""
    exclude_modules: Any = None
    """modules LoRA leaves out of `target_modules` (peft's `exclude_modules`): a regular expression the whole module
    name must match (`.*visual.*`), or a list of names (a name matches a module whose name ends with it)"""
    override_config: dict = field(default_factory=dict)
    """entries set on the model config before loading (e.g. `attention_dropout`)"""
    custom_chat_template: Optional[str] = None
    """a Jinja chat template that replaces the tokenizer's own (and a vision-language model's processor's), as verl
    sets it: prompts, multi-turn episodes, agent programs' server and the checkpoints' tokenizer all use it (checked to
    parse when the config loads)"""
    dtype: str = "auto"
    """compute dtype: `auto` = bf16 where the hardware supports it (a CPU needs AVX512-BF16 or AMX), else fp32; or
    `bf16`, `fp16`, `fp32` (autocast in one process, FSDP's mixed precision when sharded). bf16 on a CPU without
    those instructions is emulated, tens of times slower than fp32: a warning at load says so"""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """AdamW learning rate"""
    lr_warmup_steps: int = -1
    """linear warmup steps; -1 = use `lr_warmup_steps_ratio`"""
    lr_warmup_steps_ratio: float = 0.0
    """warmup as a share of the total steps"""
    warmup_style: Optional[str] = None
    """`constant` or `cosine` after warmup"""
    lr_scheduler_type: str = "constant"
    """`constant` or `cosine` after warmup"""
    min_lr_ratio: float = 0.0
    """cosine floor as a share of `lr`"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas"""
    total_training_steps: int = -1
    """scheduler horizon; -1 = the trainer's step count"""


@dataclass
class MixedPrecisionConfig:
    param_dtype: Optional[str] = None
    """FSDP2 `MixedPrecisionPolicy`: compute dtype (null = `model.dtype`) and gradient-reduction dtype;
    `buffer_dtype` is accepted and has no effect"""
    reduce_dtype: str = "fp32"
    """FSDP2 `MixedPrecisionPolicy`: compute dtype (null = `model.dtype`) and gradient-reduction dtype;
    `buffer_dtype` is accepted and has no effect"""
    buffer_dtype: str = "fp32"
    """FSDP2 `MixedPrecisionPolicy`: compute dtype (null = `model.dtype`) and gradient-reduction dtype;
    `buffer_dtype` is accepted and has no effect"""


@dataclass
class FSDPConfig:
    param_offload: bool = False
    """keep parameters, gradients and Adam state in CPU memory (FSDP2 `CPUOffloadPolicy`; shards even one process)"""
    optimizer_offload: bool = False
    """keep Adam state in CPU memory between optimizer steps (on a GPU; nothing to move on a CPU run)"""
    fsdp_size: int = -1
    """ranks per FSDP shard group (-1 = all data-parallel ranks; a divisor gives HSDP: shard within groups, replicate
    across them)"""
    tp_size: int = 1
    """tensor-parallel degree: attention and MLP projections split over this many ranks (the model's own plan,
    colwise/rowwise); a 2-D mesh with FSDP over the rest. The same layout holds for ref and critic"""
    model_dtype: str = "fp32"
    """dtype of the stored (sharded) weights and so of the optimizer's parameters"""
    reshard_after_forward: bool = True
    """free each gathered layer after its forward (False keeps it until backward: faster, more memory)"""
    use_torch_compile: Optional[bool] = None
    """compile each decoder layer's forward and backward with `torch.compile` (one graph for all layers, dynamic
    shapes; passes without gradients and decoding stay eager; a failed compilation warns and runs eagerly). null: the
    actor's setting for ref and critic; for the actor, compiled for a model of 20M parameters or more training in fp32
    on a CPU (where the gain pays for the compilation within about ten steps), eager otherwise: smaller models, bf16,
    and GPUs until measured there (docs/performance.md).
    verl's `actor.use_torch_compile` / `ref.use_torch_compile` set this key"""
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """`vanilla` (PPO dual-clip), `gpg`, `gspo`, `cispo`, `clip_cov`, `kl_cov`, `geo_mean`, `sapo`, `dppo_tv`,
    `dppo_kl`, `dro`, or a registered loss (docs/algorithms.md)"""
    clip_cov_ratio: float = 0.0002
    """`clip_cov`: share of tokens whose gradient is dropped"""
    clip_cov_lb: float = 1.0
    """`clip_cov`: lower end of the covariance window of the candidates"""
    clip_cov_ub: float = 5.0
    """`clip_cov`: upper end of the covariance window of the candidates"""
    kl_cov_ratio: float = 0.0002
    """`kl_cov`: share of tokens (largest covariance) penalised"""
    ppo_kl_coef: float = 0.1
    """`kl_cov`: coefficient of the `|log-ratio|` penalty"""
    dro_beta: Optional[float] = None
    """`dro`: beta of the quadratic penalty `beta / 2 * (logp - logp_old)^2` (required there, > 0)"""


@dataclass
class RouterReplayConfig:
    mode: str = "disabled"
    """MoE router replay (docs/algorithms.md): `R2` records each token's experts in the old-log-prob pass and the
    update's forwards route every token to them; `R3` records them in the rollout (posttrain's engine, with
    `rollout.enable_rollout_routing_replay=True`, as verl) and both the old-log-prob pass and the update replay them;
    `disabled`. verl's `megatron.router_replay.mode` / `veomni.router_replay.mode` set this key"""


@dataclass
class CheckpointConfig:
    save_contents: list = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """what a checkpoint holds; add `hf_model` to also write a plain Hugging Face folder (`actor/huggingface`) of
    each saved checkpoint, by rank 0 in the background while training goes on (a failed export is a warning: the
    checkpoint is saved)"""
    load_contents: Optional[list] = None
    """what a resume loads (null = `save_contents`)"""


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    """`fsdp`/`fsdp2`: FSDP2 when sharded (see "Processes and sharding"); `megatron`: its layout runs as FSDP2 x
    tensor parallel x row replicas (its pipeline ranks) x Ulysses (its context ranks), keeping Megatron's
    data-parallel size (a note says how the devices are used)"""
    ppo_mini_batch_size: int = 256
    """prompts per optimizer step (whole prompt groups, split over the data-parallel ranks)"""
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    """responses per forward/backward; null = whole mini-batch"""
    use_dynamic_bsz: bool = False
    """micro-batches of at most `ppo_max_token_len_per_gpu` tokens, as many on every rank: real tokens when the
    forward runs packed (`model.use_remove_padding`), else padded positions of rows of similar length (rows x
    (longest prompt + longest response)); a longer row alone gets its own"""
    ppo_max_token_len_per_gpu: int = 16384
    """token budget of a dynamic micro-batch: real tokens when packed, else padded positions (rows x padded
    width)"""
    ppo_epochs: int = 1
    """passes over each batch"""
    shuffle: bool = False
    """shuffle the prompt groups (seeded, restored on resume) before splitting into mini-batches"""
    grad_clip: float = 1.0
    """gradient-norm clip"""
    clip_ratio: float = 0.2
    """PPO clip; fallback for `clip_ratio_low` / `clip_ratio_high`"""
    clip_ratio_low: Optional[float] = None
    """asymmetric clip (DAPO clip-higher)"""
    clip_ratio_high: Optional[float] = None
    """asymmetric clip (DAPO clip-higher)"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages (> 1)"""
    loss_agg_mode: str = "token-mean"
    """`token-mean`, `token-sum` (no normaliser), `seq-mean-token-sum`, `seq-mean-token-mean`,
    `seq-mean-token-sum-norm`"""
    loss_scale_factor: Optional[float] = None
    """`C` of `seq-mean-token-sum-norm` (null = `data.max_response_length`)"""
    entropy_coeff: float = 0.0
    """entropy bonus coefficient"""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallel: each packed micro-batch is split along the sequence over this many ranks, which
    hold the same rows; around attention an all-to-all gives each rank the whole sequence for heads / sp heads.
    Activation memory per rank falls by about sp (docs/scaling.md). Needs `model.use_remove_padding`, attention
    and key/value heads divisible by it, full attention, text models; not with tp_size > 1 or fsdp_size. The same
    layout holds for ref and critic"""
    row_replicas: int = 1
    """groups of this many ranks compute the same rows, whole, and shard the model between them (FSDP2), their
    gradients averaged: how a Megatron layout's pipeline ranks (`megatron.pipeline_model_parallel_size`) keep
    Megatron's data-parallel size, processes / (tp x sp x row_replicas); not with fsdp_size. The same layout holds
    for ref and critic"""
    use_kl_loss: bool = False
    """add `kl_loss_coef * agg(kl(logp, logp_ref))` to the actor loss (loads the reference)"""
    kl_loss_coef: float = 0.001
    """its coefficient"""
    kl_loss_type: str = "low_var_kl"
    """`kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`, each with optional `+`"""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = 1.0
    """`sapo`: gate temperature for positive advantages"""
    tau_neg: float = 1.05
    """`sapo`: gate temperature for negative advantages"""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
    calculate_sum_pi_squared: bool = False
    """accepted for portability: `sum_v pi_v^2` is computed whenever the estimator reads it
    (`optimal_token_baseline`)"""
    freeze_vision_tower: bool = False
    """vision-language models: the vision encoder (and its merger) is not trained; an error for a text-only model"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """responses per reference forward"""
    log_prob_use_dynamic_bsz: bool = False
    """token-budget micro-batches"""
    log_prob_max_token_len_per_gpu: int = 16384
    """token-budget micro-batches"""
    ulysses_sequence_parallel_size: Optional[int] = None
    """null = the actor's; any other value must equal it (one layout for every role)"""
    fsdp_config: FSDPConfig = field(default_factory=lambda: FSDPConfig(param_offload=False))
    """param_offload: keep the reference weights in CPU memory between uses (FSDP2 CPU offload when sharded; in one
    plain process on a GPU the model moves in and out per step; nothing to move on a CPU run)
    optimizer_offload: accepted for portability: the reference has no optimizer
    fsdp_size, tp_size: as the actor's; must be left unset or equal the actor's
    model_dtype, reshard_after_forward: as the actor's keys; `fsdp_size` / `tp_size` must be left unset or equal the
    actor's
    mixed_precision.*: as the actor's key"""


@dataclass
class ValKwargsConfig:
    n: int = 1
    """validation sampling"""
    do_sample: bool = False
    """validation sampling"""
    temperature: float = 0.0
    """validation sampling"""
    top_p: float = 1.0
    """validation sampling"""
    top_k: int = -1
    """validation sampling"""


@dataclass
class MultiTurnConfig:
    enable: bool = False
    """True: each sample is an episode (docs/agents.md): the policy writes a turn, the row's environment (its
    `agent_name` column, else `agent.default_agent_loop`) answers with tool results or a user message, and the policy
    goes on from the tokens it sampled, until a turn without a tool call, a turn limit below, or
    `data.max_response_length`, which counts every token after the prompt (the episode is then truncated, counted).
    `response_mask` is 1 on the policy's tokens only. Runs on posttrain's engine (not `rollout.name=hf`); a
    vision-language model's episodes carry the rows' images (turn by turn, answers appended as text)"""
    max_assistant_turns: Optional[int] = None
    """most assistant (policy) turns of an episode; null = no limit but the response budget"""
    max_user_turns: Optional[int] = None
    """most environment rounds of an episode, counted as verl counts its user turns: each answer of the environment
    that appends messages is one, whatever their roles and number (a round of three tool results is one); checked
    after each assistant turn, so N rounds allow N + 1 assistant turns; null = no limit but the response budget"""
    max_parallel_calls: int = 1
    """most tool calls of one assistant turn that are run (concurrently, each within `tool_timeout_s`)"""
    max_tool_response_length: int = 256
    """a tool result longer than this many characters is cut (`tool_response_truncate_side`) before it is appended"""
    tool_response_truncate_side: str = "middle"
    """which side of a long tool result is cut, as in verl: `left` (the end is kept), `right` (the start is kept) or
    `middle` (half the length from each end is kept); a marker says it was truncated"""
    tool_config_path: Optional[str] = None
    """YAML of stateful tools (`tools: - class_name, config, tool_schema`; one instance per episode, created with the
    row's `extra_info.tools_kwargs`); verl's example tool class names resolve to posttrain's built-ins"""
    function_tool_path: Optional[str] = None
    """Python file of plain functions decorated with `posttrain.tools.function_tool` (schema from the signature and
    docstring); may be set together with `tool_config_path` (a name in both is an error)"""
    format: str = "hermes"
    """how tool calls are written in the policy's text: `hermes` (`<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`, as the Qwen2.5 / Qwen3 chat templates write them) or `gpt-oss` (OpenAI's harmony format of
    gpt-oss models: a message to `functions.NAME` whose content is the arguments' JSON, read from the turn decoded
    with its special tokens, its analysis messages never read for calls; the tool answers appended in harmony's
    format, as verl writes them); `qwen` and `qwen25`, SGLang's names for the hermes format (which verl's SGLang
    rollout passed on), are read as `hermes`"""
    use_inference_chat_template: bool = False
    """False (the only value): the policy continues from exactly the tokens it sampled, reasoning included, and only
    the appended messages are tokenized; True (re-rendering earlier turns with the chat template, which may drop
    their reasoning) is rejected"""
    tokenization_sanity_check_mode: str = "strict"
    """at an episode's end, compare its tokens with the chat template's rendering of its whole conversation:
    `strict` (any difference), `ignore_strippable` (differences in whitespace only are ignored) or `disable`; a
    mismatch is counted in `agent/tokenization_mismatch`, and training goes on with the sampled tokens"""
    tool_timeout_s: float = 30.0
    """time limit of one tool call in seconds (posttrain's key); a call past it returns a timeout message to the
    policy and is counted in `agent/tool_errors`"""


@dataclass
class AgentConfig:
    default_agent_loop: str = "single_turn_agent"
    """the environment of rows without an `agent_name` column (or with it null): `single_turn_agent` (the episode
    ends after the first turn), `tool_agent` (the multi_turn tools), or a name registered with
    `posttrain.agents.register_environment` (checked when the run starts). Another value than `single_turn_agent`
    needs `multi_turn.enable=True`"""
    num_workers: int = 8
    """threads per process that run environment steps (tool calls among them) while the other episodes decode; with
    `program`, the programs that run at once per process (the server decodes their requests together: raise it)"""
    agent_loop_config_path: Optional[str] = None
    """a YAML list in verl's layout (`- name: NAME` / `_target_: package.module.Class`): each target, an environment
    class or a factory taking the run's agent settings, is registered under its name in every process when the run
    starts, so rows can name it in `agent_name`. verl's own agent-loop classes (an async `run()`) are refused: write
    the turn logic as an environment (docs/agents.md)"""
    program: Optional[str] = None
    """an agent program plays every episode instead of the environments: `module:function` or
    `path/to/file.py:function` (a Python function `fn(row, base_url, api_key) -> reward or None`, run in a thread), or
    a command line (run per sample with the row as JSON on stdin and `OPENAI_BASE_URL` / `OPENAI_API_KEY` set; it may
    print `{"reward": x}` last). It talks to an OpenAI-compatible server over the policy, which records the tokens
    trained on; its reward, else `POST /rl/reward`, else the data_source's scorer (docs/agents.md, "Agent programs
    over the OpenAI API"). A function that does not import is refused when the config loads"""
    program_timeout_s: float = 600.0
    """each program run's time limit in seconds (a command is killed, a function abandoned): the sample is dropped
    and counted in `agent/program_errors/timeout`"""


@dataclass
class RolloutConfig:
    name: str = "posttrain"
    """`posttrain` (posttrain's engine), `hf` (transformers' `generate`) or `vllm` (vLLM's engine, which must be
    installed: docs/rollout_engines.md); `sglang` and `trtllm` are accepted and run on `posttrain` (a note says so)"""
    enable_rollout_routing_replay: bool = False
    """record the experts every token of the rollout was routed to (posttrain's engine; for
    `actor.router_replay.mode=R3`, which needs it, as in verl)"""
    mode: str = "async"
    """`async` or `sync`, the same here: posttrain's engine decodes the step's live samples together, and an episode
    whose tools are running leaves the batch and rejoins when they answer, either way"""
    n: int = 1
    """samples per prompt"""
    temperature: float = 1.0
    """sampling; `top_k=-1` = off"""
    top_p: float = 1.0
    """sampling; `top_k=-1` = off"""
    top_k: int = -1
    """sampling; `top_k=-1` = off"""
    do_sample: bool = True
    """False = greedy"""
    response_length: Optional[int] = None
    """generated tokens: null or equal to `data.max_response_length`, which bounds generation, the overlong penalty
    and the `seq-mean-token-sum-norm` constant alike; another value is rejected"""
    prompt_length: Optional[int] = None
    """null or equal to `data.max_prompt_length` (which bounds prompts); another value is rejected"""
    dtype: str = "auto"
    """dtype of generation (as `model.dtype`)"""
    ignore_eos: bool = False
    """keep generating past EOS up to `response_length`"""
    calculate_log_probs: bool = False
    """the engine also returns each sampled token's log-prob under the distribution it was drawn from
    (`rollout_log_probs`), and `logp_old` is computed in its own pass (otherwise skipped when one mini-batch and one
    epoch make it `sg(logp)`); the gap between the two is logged as `training/rollout_probs_diff_max` / `_mean` /
    `_std` and `training/rollout_actor_probs_pearson_corr` (docs/algorithms.md)"""
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    """responses per old-log-prob forward"""
    log_prob_use_dynamic_bsz: bool = False
    """token-budget micro-batches"""
    log_prob_max_token_len_per_gpu: int = 16384
    """token-budget micro-batches"""
    micro_batch_size: Optional[int] = None
    """prompts generated in one `generate` call; null = all"""
    # Keys of the vLLM engine (rollout.name=vllm; with another engine a note says they have no effect).
    tensor_model_parallel_size: int = 1
    """vLLM: tensor-parallel groups of this many consecutive training processes, each group generating its members'
    prompts together (must divide the processes; verl's default is 2, vLLM's 1)"""
    gpu_memory_utilization: float = 0.5
    """vLLM: the share of the device's memory its engine may use, the KV cache taking what the weights leave (on a
    CPU: of the machine's memory, this process's own included; `VLLM_CPU_KVCACHE_SPACE`, in GiB, sizes the KV cache
    instead when set)"""
    enforce_eager: bool = False
    """False: on a GPU, posttrain's engine replays each decoding step as a CUDA graph (one process; sharded and MoE
    models decode eagerly), and vLLM compiles its model (CUDA graphs; on a CPU, torch.compile at start-up); True:
    eager steps"""
    free_cache_engine: bool = True
    """vLLM on a GPU: the engine sleeps while the trainer runs (weights to CPU memory, KV cache freed) and wakes for
    each generate call; does nothing on a CPU (no sleep mode there; a note says so)"""
    load_format: str = "auto"
    """vLLM: how its engine reads the model's weights at start-up (`auto`, `safetensors`, `pt`, ...); `dummy` reads
    none. Either way the trainer's weights replace them before the first generation"""
    max_num_batched_tokens: int = 8192
    """vLLM: most tokens one engine step computes (prefill chunks and decoding rows together)"""
    max_num_seqs: int = 1024
    """vLLM: most sequences decoded together"""
    enable_chunked_prefill: bool = True
    """vLLM: long prompts are prefilled in chunks beside decoding rows; False: each prompt in one step (then
    `max_num_batched_tokens` must be at least `max_model_len`)"""
    max_model_len: Optional[int] = None
    """vLLM: longest sequence (prompt + response) its engine holds; null = `data.max_prompt_length` +
    `data.max_response_length`"""
    update_weights_bucket_megabytes: int = 512
    """weights travel in buckets of at most this many MB: asynchronous RL (`rollout.n_gpus_per_node` > 0) broadcasts
    each to the generating processes; vLLM gathers a sharded policy that many MB at a time and loads them"""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True
    """actor and rollout share weights (the only mode; False is rejected)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
