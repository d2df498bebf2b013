"""The modules the roles train: a policy whose forward returns response log-probs, and a value model.

Why wrap the causal LM: the chunked log-prob head reads the output projection's weight outside the LM's own forward.
Inside this wrapper's forward it is part of one module call, so a sharding wrapper applied to the wrapper (FSDP2)
has the head's weight gathered for exactly that call and its backward — no special case for sharded heads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .logprobs import response_logprobs


class PolicyModel(nn.Module):
    """`forward(input_ids, attention_mask, response_length)` -> (log-probs, entropy or None), each (B, L)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, response_length: int, temperature: float = 1.0,
                with_entropy: bool = True, chunk_size: int = 1024):
        return response_logprobs(self.lm, input_ids, attention_mask, response_length, temperature=temperature,
                                 chunk_size=chunk_size, with_entropy=with_entropy)

    def generate(self, **kwargs):
        """The LM's own `generate`; called through this wrapper so that a sharded root sees the call."""
        return self.lm.generate(**kwargs)

    @property
    def config(self):
        return self.lm.config

    @property
    def generation_config(self):
        return self.lm.generation_config


class ValueModel(nn.Module):
    """Decoder backbone of a causal LM plus a linear head to one value per position."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype: torch.dtype = torch.float32, meta: bool = False,
                        trust_remote_code=False, override_config=None, gradient_checkpointing=False) -> "ValueModel":
        """The backbone of the causal LM at `path` (a critic export also restores its `value_head.safetensors`)."""
        from transformers import AutoModel

        from .load import enable_checkpointing, model_config

        config = model_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
        if meta:
            with torch.device("meta"):
                backbone = AutoModel.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
                model = cls(backbone, config.hidden_size).to(dtype)
        else:
            backbone = AutoModel.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=trust_remote_code)
            model = cls(backbone, config.hidden_size).to(dtype)
            head = Path(path) / "value_head.safetensors"
            if head.is_file():
                from safetensors.torch import load_file

                model.value_head.load_state_dict(load_file(str(head)))
            model = model.to(device)
        if gradient_checkpointing:
            enable_checkpointing(backbone)
        return model

    def forward(self, input_ids, attention_mask) -> torch.Tensor:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1)

    def save_pretrained(self, path, **kwargs) -> None:
        """A plain directory: the backbone as transformers saves it, the head as `value_head.safetensors`."""
        from safetensors.torch import save_file

        self.backbone.save_pretrained(path, **kwargs)
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()},
                  str(Path(path) / "value_head.safetensors"))
