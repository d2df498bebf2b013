"""Load a Hugging Face causal LM and its tokenizer (a local folder or a hub id, see hub.py), and pick the device and
compute dtype."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers.utils import logging as hf_logging

from .cpu_bf16 import cpu_bf16_native, warn_emulated_bf16
from .hub import resolve_model_source

hf_logging.disable_progress_bar()  # per-file load/save bars drown the training output


def pick_device(name: str = "auto") -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from ..errors import ConfigError

            raise ConfigError("trainer.device=cuda but no CUDA device is available (torch.cuda.is_available() is "
                              "False); use trainer.device=auto or cpu")
        return torch.device("cuda")
    return torch.device("cpu")


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return cpu_bf16_native()


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` = bf16 where the hardware runs it natively, else fp32; bf16 asked for on a CPU that emulates it is
    kept, with one warning (cpu_bf16.py)."""
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if name == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    if table[name] == torch.bfloat16 and device.type == "cpu" and not cpu_bf16_native():
        warn_emulated_bf16()
    return table[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision around forward passes; weights and optimizer state stay fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def attention_backends(device: torch.device):
    """On a GPU, sdpa without its cuDNN backend. cuDNN builds an execution plan for every new input shape (about
    10 ms of CPU per attention call on an H100, torch 2.11: more than half of a training phase's time, measured in
    docs/performance.md), and RL batches change shape at every step; flash and memory-efficient attention do not."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@contextlib.contextmanager
def eval_mode(model):
    """Dropout off for passes that must be deterministic (log-probs, values, decoding), the mode restored after;
    updates run in train mode, so a model with dropout trains with it, as its config asks."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def load_tokenizer(path: str, trust_remote_code: bool = False, *, key: str = "tokenizer path",
                   chat_template: str | None = None):
    """`key` is the setting `path` came from, named in the error when it leads to no tokenizer. `chat_template`
    replaces the tokenizer's own (`model.custom_chat_template`, as verl sets it on the tokenizer it loads)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_source(path, key=key), trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def model_config(path: str, *, trust_remote_code: bool = False, override_config: dict | None = None,
                 key: str = "model path"):
    """The model's config with the `override_config` entries set on it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_source(path, key=key), trust_remote_code=trust_remote_code)
    _override(config, override_config or {}, f"{key.rsplit('.', 1)[0]}.override_config" if "." in key else
              "override_config")
    return config


def _override(config, entries: dict, where: str) -> None:
    """Set entries on a model config (nested dicts on its sub-configs); a field the config lacks is an error,
    since a misspelt override would otherwise be ignored by the model."""
    from transformers import PretrainedConfig

    from ..errors import ConfigError

    for name, value in entries.items():
        if not hasattr(config, name):
            fields = sorted(k for k in config.to_dict() if not k.startswith("_"))
            raise ConfigError(f"{where}.{name}: the model config ({type(config).__name__}) has no field '{name}'; "
                              f"its fields: {', '.join(fields)}")
        current = getattr(config, name)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            _override(current, value, f"{where}.{name}")
        else:
            setattr(config, name, value)


def load_causal_lm(path: str, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   meta: bool = False, trust_remote_code: bool = False, override_config: dict | None = None,
                   gradient_checkpointing: bool = False, lora: "LoraSettings | None" = None, key: str = "model path"):
    """Weights in `dtype` (mixed precision comes from autocast or FSDP's policy), or the bare structure on the
    meta device (`meta=True`: the weights arrive later from rank 0); optional activation checkpointing and LoRA.
    A vision-language model (a config with a `vision_config`) loads as image-text-to-text."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .vision import is_vision_config

    path = resolve_model_source(path, key=key)
    config = model_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    if meta:
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    else:
        model = auto.from_pretrained(path, config=config, dtype=dtype,
                                     trust_remote_code=trust_remote_code).to(device)
    if gradient_checkpointing:
        enable_checkpointing(model)
        model.config.use_cache = False
    if lora is not None:
        model = lora.apply(model)
    return model


def load_reward_model(path: str, *, dtype: torch.dtype = torch.float32, meta: bool = False,
                      trust_remote_code: bool = False, key: str = "reward_model.model.path"):
    """A scalar reward model: a sequence classifier with one label. Anything else (a causal LM, a classifier with
    several labels) would get a freshly initialised head from transformers, so it is refused by name."""
    from transformers import AutoModelForSequenceClassification

    from ..errors import ConfigError

    path = resolve_model_source(path, key=key)
    config = model_config(path, trust_remote_code=trust_remote_code, key=key)
    arch = list(getattr(config, "architectures", None) or [])
    if not any(a.endswith("ForSequenceClassification") for a in arch) or config.num_labels != 1:
        raise ConfigError(f"{key}='{path}' is {arch or 'a model of unknown architecture'} with {config.num_labels} "
                          "labels; posttrain's reward models are sequence classifiers with one label "
                          "(AutoModelForSequenceClassification, num_labels=1). A causal LM can grade responses as a "
                          "generative judge: set reward_model.judge.enable=True")
    if meta:
        with torch.device("meta"):
            return AutoModelForSequenceClassification.from_config(config, dtype=dtype,
                                                                  trust_remote_code=trust_remote_code)
    return AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype,
                                                              trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class LoraSettings:
    """`actor_rollout_ref.model.lora_rank / lora_alpha / target_modules / exclude_modules / lora_adapter_path` for
    peft's LoRA."""

    rank: int
    alpha: float = 16
    target_modules: object = "all-linear"
    exclude_modules: object = None
    adapter_path: str | None = None  # a saved adapter to continue from: its own config, and its weights

    def apply(self, model):
        from peft import LoraConfig, PeftModel, get_peft_model

        if self.adapter_path:
            if next(model.parameters()).is_meta:  # the structure only: the weights arrive from rank 0
                config = LoraConfig.from_pretrained(self.adapter_path)
                config.inference_mode = False
                return get_peft_model(model, config)
            return PeftModel.from_pretrained(model, self.adapter_path, is_trainable=True)

        targets = self.target_modules
        if isinstance(targets, str) and targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        excluded = self.exclude_modules
        excluded = (list(excluded) or None) if isinstance(excluded, (list, tuple)) else excluded or None
        config = LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, exclude_modules=excluded,
                            lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        return get_peft_model(model, config)


def enable_checkpointing(model) -> None:
    """Activation checkpointing under whichever name this transformers version uses."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
