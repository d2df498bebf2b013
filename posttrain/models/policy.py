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

from .logprobs import _unwrap, keeps_one_logit, response_logprobs
from .shared_prompt import each_row_its_own_prompt, shared_prompt_hidden, switch_on_if_equal
from ..parallel.ulysses import active_group
from .vision import forward_inputs, is_vision_config

log = logging.getLogger(__name__)


class PolicyModel(nn.Module):
    """`forward(input_ids, attention_mask, response_length)` -> (log-probs, entropy or None), each (B, L).

    With `prompts=(prompt_rows, row_prompt)` (rows that share a prompt, see `response_logprobs`) each distinct
    prompt is computed once — after a one-time check that this model gives the plain path's log-probs that way.
    A MoE model's router logits go to `router` (a moe.RouterRecorder) when one is given; `extra_tokens` adds a third
    output (top-k log-probs and ids, or the log-probs of given ids: see `response_logprobs`)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.shared_prompt_ok: bool | None = None
        self.packed_ok: bool | None = None

    def forward(self, input_ids, attention_mask, response_length: int, temperature: float = 1.0,
                with_entropy: bool = True, chunk_size: int = 1024, prompts=None, images=None, router=None,
                extra_tokens=None, packed: bool = False):
        """`packed=True` (where `packs()`): the rows run padding-free (models/packed.py), prompts shared or not."""
        kwargs = dict(temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy, router=router,
                      extra_tokens=extra_tokens)
        packed = packed and self.packs()
        if packed and active_group() is not None:
            prompts = None  # a sequence-parallel call shares no prompts
        # the one-time check first: every rank of a sharded model runs it in the same call, whatever its rows
        if prompts is None or not self._shares_prompts(packed) or each_row_its_own_prompt(self, prompts,
                                                                                           len(input_ids)):
            prompts = None  # a model that keeps the plain path, or no prompt shared
        return response_logprobs(self.lm, input_ids, attention_mask, response_length, prompts=prompts,
                                 images=images, packed=packed, **kwargs)

    def packs(self) -> bool:
        """Whether this model runs packed rows: once, a check that they give the padded forward's log-probs."""
        if self.packed_ok is None and is_vision_config(self.lm.config):
            log.warning("log-probs of %s: computed on padded rows (the packed path takes no image inputs)",
                        type(_unwrap(self.lm)).__name__)
            self.packed_ok = False
        if self.packed_ok is None:
            self.packed_ok = keeps_one_logit(_unwrap(self.lm)) and switch_on_if_equal(
                self, self.lm.config.get_text_config(),
                lambda ids, mask, L: response_logprobs(self.lm, ids, mask, L, with_entropy=False)[0],
                lambda ids, mask, L: response_logprobs(self.lm, ids, mask, L, with_entropy=False, packed=True)[0],
                "log-probs", packed=True)
        return self.packed_ok

    def _shares_prompts(self, packed: bool = False) -> bool:
        """Once: whether the shared-prompt pass (packed when `packed`: the path this model runs) gives the plain
        path's log-probs."""
        if self.shared_prompt_ok is None and is_vision_config(self.lm.config):
            log.warning("log-probs of %s: computed without sharing prompts (the shared-prompt pass takes no image "
                        "inputs)", type(_unwrap(self.lm)).__name__)
            self.shared_prompt_ok = False
        if self.shared_prompt_ok is None:
            text = self.lm.config.get_text_config()
            self.shared_prompt_ok = keeps_one_logit(_unwrap(self.lm)) and switch_on_if_equal(
                self, text,
                lambda ids, mask, L: response_logprobs(self.lm, ids, mask, L, with_entropy=False)[0],
                lambda ids, mask, L, groups: response_logprobs(self.lm, ids, mask, L, with_entropy=False,
                                                               prompts=groups, packed=packed)[0],
                "log-probs")
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
        self.shared_prompt_ok: bool | None = None
        self.packed_ok: bool | None = None
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype: torch.dtype = torch.float32, meta: bool = False,
                        trust_remote_code=False, override_config=None, gradient_checkpointing=False,
                        key: str = "model path") -> "ValueModel":
        """The backbone of the causal LM at `path` (a critic export also restores its `value_head.safetensors`)."""
        from transformers import AutoModel

        from .hub import resolve_model_source
        from .load import enable_checkpointing, model_config

        path = resolve_model_source(path, key=key)
        config = model_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
        if meta:
            with torch.device("meta"):
                backbone = AutoModel.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
                model = cls(backbone, config.get_text_config().hidden_size).to(dtype)
        else:
            backbone = AutoModel.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=trust_remote_code)
            model = cls(backbone, config.get_text_config().hidden_size).to(dtype)
            head = Path(path) / "value_head.safetensors"
            if head.is_file():
                from safetensors.torch import load_file

                model.value_head.load_state_dict(load_file(str(head)))
            model = model.to(device)
        if gradient_checkpointing:
            enable_checkpointing(backbone)
        return model

    def forward(self, input_ids, attention_mask, response_length: int | None = None, prompts=None,
                images=None, packed: bool = False) -> torch.Tensor:
        """Values (B, T) of every position; with `response_length` L, (B, L): those of the positions that predict
        the response tokens, each distinct prompt computed once when `prompts` groups the rows (as for
        PolicyModel), or the rows run padding-free with `packed` (where `packs()`; 0 where the response is
        padding). A vision-language backbone takes each row's image inputs in `images` (vision.py)."""
        if response_length is not None and packed and self.packs():
            if active_group() is not None:
                prompts = None  # a sequence-parallel call shares no prompts
            if prompts is not None and (not self._shares_prompts(packed=True)
                                        or each_row_its_own_prompt(self, prompts, len(input_ids))):
                prompts = None
            return self._packed_values(input_ids, attention_mask, response_length, prompts)
        if response_length is not None and prompts is not None and self._shares_prompts() \
                and not each_row_its_own_prompt(self, prompts, len(input_ids)):  # the check first, as in PolicyModel
            hidden = shared_prompt_hidden(self._hidden, input_ids, attention_mask, response_length, *prompts)
            return self.value_head(hidden).squeeze(-1)
        extra = (forward_inputs(self.backbone, self.backbone.config, input_ids, attention_mask, images)
                 if is_vision_config(self.backbone.config) else {})
        values = self.value_head(self._hidden(input_ids=input_ids, attention_mask=attention_mask,
                                              **extra)).squeeze(-1)
        return values if response_length is None else values[:, -(response_length + 1):-1]

    def _packed_values(self, input_ids, attention_mask, response_length: int, prompts=None) -> torch.Tensor:
        from .packed import mask_off, pack, predictors
        from .shared_prompt import ATTENTION_NAME, packed_shared_prompt_hidden
        from ..parallel.ulysses import active_group, on_this_share, split, sum_over_group

        if self.backbone.config._attn_implementation != ATTENTION_NAME:
            raise ValueError(f"packed rows need the model's attention implementation set to {ATTENTION_NAME}")
        if prompts is not None:
            hidden, valid, at = packed_shared_prompt_hidden(lambda _weights, **inputs: self._hidden(**inputs),
                                                            input_ids, attention_mask, response_length, *prompts)
        elif active_group() is not None:  # this rank's share of the row (ulysses.py)
            rows, group = pack(input_ids, attention_mask), active_group()
            ids, positions, packing, start = split(rows, group)
            with mask_off():
                hidden = self._hidden(input_ids=ids, attention_mask=None, position_ids=positions, packed=packing)[0]
            mine, at = on_this_share(*predictors(rows, response_length), start, hidden.shape[0])
            values = self.value_head(hidden.index_select(0, at)).squeeze(-1)
            return sum_over_group(values.new_zeros(mine.shape).masked_scatter(mine, values), group, hidden)
        else:
            rows = pack(input_ids, attention_mask)
            with mask_off():
                hidden = self._hidden(input_ids=rows.input_ids, attention_mask=None, position_ids=rows.position_ids,
                                      packed=rows.packing)[0]
            valid, at = predictors(rows, response_length)
        values = self.value_head(hidden.index_select(0, at)).squeeze(-1)
        return values.new_zeros(valid.shape).masked_scatter(valid, values)

    def packs(self) -> bool:
        """Whether this model runs packed rows: once, a check that they give the padded forward's values."""
        if self.packed_ok is None and is_vision_config(self.backbone.config):
            log.warning("values of %s: computed on padded rows (the packed path takes no image inputs)",
                        type(self.backbone).__name__)
            self.packed_ok = False
        if self.packed_ok is None:
            self.packed_ok = switch_on_if_equal(
                self, self.backbone.config,
                lambda ids, mask, L: self(ids, mask, L) * mask[:, -L:],
                lambda ids, mask, L: self._packed_values(ids, mask, L), "values", packed=True)
        return self.packed_ok

    def _hidden(self, *, input_ids, attention_mask, position_ids=None, **kwargs) -> torch.Tensor:
        if position_ids is None:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False, **kwargs).last_hidden_state

    def _shares_prompts(self, packed: bool = False) -> bool:
        if self.shared_prompt_ok is None and is_vision_config(self.backbone.config):
            log.warning("values of %s: computed without sharing prompts (the shared-prompt pass takes no image "
                        "inputs)", type(self.backbone).__name__)
            self.shared_prompt_ok = False
        if self.shared_prompt_ok is None:
            self.shared_prompt_ok = switch_on_if_equal(
                self, self.backbone.config,
                lambda ids, mask, L: self(ids, mask, L) * mask[:, -L:],
                lambda ids, mask, L, groups: mask[:, -L:] * (
                    self._packed_values(ids, mask, L, groups) if packed else
                    self.value_head(shared_prompt_hidden(self._hidden, ids, mask, L, *groups)).squeeze(-1)),
                "values")
        return self.shared_prompt_ok

    def save_pretrained(self, path, **kwargs) -> None:
        """A plain directory: the backbone as transformers saves it, the head as `value_head.safetensors`."""
        from safetensors.torch import save_file

        self.backbone.save_pretrained(path, **kwargs)
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()},
                  str(Path(path) / "value_head.safetensors"))
