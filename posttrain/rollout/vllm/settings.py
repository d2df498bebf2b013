"""From posttrain's config to the arguments of vLLM's `LLM`: every engine key of `actor_rollout_ref.rollout` either
reaches vLLM here or is refused when the config loads (config/rollout_engine.py). No vLLM import: the mapping is
plain data, testable where vLLM is not installed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

WORKER_EXTENSION = "posttrain.rollout.vllm.worker.TrainerWeights"


@dataclass(frozen=True)
class EngineSettings:
    model_path: str  # a local model folder (configuration; the weights too unless load_format=dummy)
    dtype: torch.dtype
    seed: int
    max_model_len: int  # prompt + response tokens of one sequence
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    free_cache_engine: bool = True
    load_format: str = "auto"
    trust_remote_code: bool = False
    override_config: dict = field(default_factory=dict)
    bucket_bytes: int = 512 << 20  # update_weights_bucket_megabytes

    @classmethod
    def from_config(cls, cfg, *, model_path: str, dtype: torch.dtype) -> "EngineSettings":
        """The settings of a run's config (`model_path`: its actor model, resolved to a local folder)."""
        r, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
        return cls(model_path=model_path, dtype=dtype, seed=cfg.trainer.seed,
                   max_model_len=r.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
                   tensor_parallel_size=r.tensor_model_parallel_size,
                   gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_num_seqs,
                   max_num_batched_tokens=r.max_num_batched_tokens, enable_chunked_prefill=r.enable_chunked_prefill,
                   enforce_eager=r.enforce_eager, free_cache_engine=r.free_cache_engine, load_format=r.load_format,
                   trust_remote_code=model.trust_remote_code, override_config=dict(model.override_config or {}),
                   bucket_bytes=r.update_weights_bucket_megabytes << 20)

    def sleeps(self, device_type: str) -> bool:
        """free_cache_engine: vLLM's sleep mode, which only its CUDA workers have (its CPU worker ignores it)."""
        return self.free_cache_engine and device_type == "cuda"

    def llm_kwargs(self, *, device_type: str, distributed: bool) -> dict:
        """`LLM(**kwargs)`. `distributed`: this process is one of a torchrun world, whose consecutive ranks vLLM
        groups by `tensor_parallel_size` (its external launcher); otherwise vLLM runs its one worker in this process.
        Sampled tokens come back with the log-prob of the distribution they were drawn from (after temperature,
        top-k, top-p: `processed_logprobs`), as posttrain's engine gives them; token ids go in and come out, so
        vLLM loads no tokenizer."""
        return dict(
            model=self.model_path, dtype=self.dtype, seed=self.seed, max_model_len=self.max_model_len,
            tensor_parallel_size=self.tensor_parallel_size, gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill, enforce_eager=self.enforce_eager,
            load_format=self.load_format, trust_remote_code=self.trust_remote_code,
            hf_overrides=self.override_config or None, enable_sleep_mode=self.sleeps(device_type),
            distributed_executor_backend="external_launcher" if distributed else "uni",
            logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION, skip_tokenizer_init=True,
            enable_prefix_caching=True)
