"""The modules the roles train: a policy whose forward returns response log-probs, and a value model.

Why wrap the causal LM: the chunked log-prob head reads the output projection's weight outside the LM's own forward.
Inside this wrapper's forward it is part of one module call, so a sharding wrapper applied to the wrapper (FSDP2)
has the head's weight gathered for exactly that call and its backward — no special case for sharded heads.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from .logprobs import _unwrap, keeps_one_logit, response_logprobs, shared_prompt_logprobs
from .shared_prompt import ATTENTION_NAME

log = logging.getLogger(__name__)


class PolicyModel(nn.Module):
    """`forward(input_ids, attention_mask, response_length)` -> (log-probs, entropy or None), each (B, L).

    With `prompts=(prompt_rows, row_prompt)` (rows that share a prompt, see `shared_prompt_logprobs`) each distinct
    prompt is computed once — after a one-time check that this model gives the plain path's log-probs that way."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.shared_prompt_ok: bool | None = None

    def forward(self, input_ids, attention_mask, response_length: int, temperature: float = 1.0,
                with_entropy: bool = True, chunk_size: int = 1024, prompts=None):
        kwargs = dict(temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
        if prompts is not None and len(prompts[0]) < len(input_ids) and self._shares_prompts(input_ids.device):
            return shared_prompt_logprobs(self.lm, input_ids, attention_mask, response_length, *prompts, **kwargs)
        return response_logprobs(self.lm, input_ids, attention_mask, response_length, **kwargs)

    def _shares_prompts(self, device) -> bool:
        """Once per model: do two prompts (one left-padded) x two responses give the plain log-probs?"""
        if self.shared_prompt_ok is not None:
            return self.shared_prompt_ok
        config = self.lm.config.get_text_config()
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        reason = None
        if config._attn_implementation != "sdpa":
            reason = f"it uses {config._attn_implementation} attention, not sdpa"
        elif kinds != {"full_attention"}:
            reason = "its layers are " + ", ".join(sorted(kinds))
        elif not keeps_one_logit(_unwrap(self.lm)):
            reason = "its forward has no logits_to_keep"
        else:
            config._attn_implementation = ATTENTION_NAME  # sdpa for every call that shares no prompt
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, min(config.vocab_size, 1000), (4, 9), generator=gen).to(device)
            mask = torch.ones_like(ids)
            mask[2:, :2] = 0  # the second prompt is left-padded
            mask[1, -1] = 0  # one response is shorter
            ids[1] = torch.where(mask[1].bool(), ids[1], 0)
            ids[1, :5], ids[3, :5] = ids[0, :5], ids[2, :5]
            groups = (torch.tensor([0, 2]), torch.tensor([0, 0, 1, 1]))
            was_training = self.training
            self.eval()
            try:
                with torch.no_grad():
                    plain, _ = response_logprobs(self.lm, ids, mask, 4, with_entropy=False)
                    shared, _ = shared_prompt_logprobs(self.lm, ids, mask, 4, *groups, with_entropy=False)
                error = float((plain.float() - shared.float()).abs().max())
                if error > (1e-4 if not torch.is_autocast_enabled(device.type) else 5e-2):
                    reason = f"its log-probs differ from the plain forward's by {error:.1e}"
            except Exception as exc:  # an architecture whose modules the shared path cannot drive
                reason = f"{type(exc).__name__}: {exc}"
            finally:
                self.train(was_training)
            if reason:
                config._attn_implementation = "sdpa"
        self.shared_prompt_ok = reason is None
        if reason:
            log.warning("log-probs of %s: computed without sharing prompts (%s)", type(self.lm).__name__, reason)
        return self.shared_prompt_ok

    def generate(self, **kwargs):
        """The LM's own `generate`; called through this wrapper so that a sharded root sees the call."""
        return self.lm.generate(**kwargs)

    def lm_forward(self, **kwargs):
        """The LM's own forward (logits, caches), through this wrapper for the same reason."""
        return self.lm(**kwargs)

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
