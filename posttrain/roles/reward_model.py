"""The scalar reward model (`reward_model.enable=True`): a sequence classifier with one label that reads each
prompt's chat plus the response in its own tokenizer and chat template, and gives the exchange one number.

Shaped like the reference: frozen, eval mode, no grad, the rollout's compute dtype (autocast in one process, FSDP2's
mixed precision when sharded over several processes, built with the same `prepare_model`). Each rank scores the
rows it generated; the micro-batch count is made equal over ranks, so a sharded model's collectives line up.
"""

from __future__ import annotations

import torch

from ..data.batch import Batch, response_attention
from ..models.load import compute_dtype, eval_mode, load_reward_model, load_tokenizer
from ..models.packed import mask_off, pack, right_padded
from ..models.shared_prompt import switch_on_if_equal
from ..parallel import Parallel, ShardSettings, prepare_model
from .common import ModelRunner


def rm_input_ids(tokenizer, messages: list[dict], response: str, max_length: int | None) -> list[int]:
    """`messages + [assistant: response]` in the reward model's chat template (without one: the contents joined
    by newlines, with the tokenizer's own special tokens), the first `max_length` tokens kept (verl's right
    truncation)."""
    chat = [*messages, {"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer("\n".join(str(m["content"]) for m in chat))["input_ids"]
    return ids[:max_length] if max_length else ids


def _score_head(model) -> torch.nn.Module | None:
    """The per-position output layer of the decoder-LM classifiers (Llama, Qwen2, Mistral, Gemma: `score`)."""
    head = getattr(model, "score", None)
    return head if isinstance(head, torch.nn.Module) else None


class RewardModel:
    def __init__(self, runner: ModelRunner, cfg, *, tokenizer, input_tokenizer):
        self.runner, self.model, self.cfg = runner, runner.model, cfg
        self.tokenizer, self.input_tokenizer = tokenizer, input_tokenizer
        self.model.eval().requires_grad_(False)
        if self.model.config.pad_token_id is None:  # transformers' classifiers refuse batches > 1 without one
            self.model.config.pad_token_id = tokenizer.pad_token_id
        self.head = _score_head(self.model)
        self.packed_ok: bool | None = None

    @classmethod
    def from_config(cls, cfg, par: Parallel, input_tokenizer=None, *, balance_batch: bool = True) -> "RewardModel":
        """`reward_model.*` of `cfg`; `input_tokenizer` decodes the policy's ids (default: the actor's tokenizer,
        or `reward_model.model.input_tokenizer` when set)."""
        rm, arr = cfg.reward_model, cfg.actor_rollout_ref
        dtype = compute_dtype(arr.rollout.dtype, par.device)
        trust = rm.model.trust_remote_code
        if rm.model.input_tokenizer:
            input_tokenizer = load_tokenizer(rm.model.input_tokenizer, trust,
                                             key="reward_model.model.input_tokenizer")
        elif input_tokenizer is None:
            key = "actor_rollout_ref.model." + ("tokenizer_path" if arr.model.tokenizer_path else "path")
            input_tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path, arr.model.trust_remote_code,
                                             key=key)
        tokenizer = load_tokenizer(rm.model.path, trust, key="reward_model.model.path")

        def build(meta: bool):
            return load_reward_model(rm.model.path, meta=meta, trust_remote_code=trust)

        model = prepare_model(build, par, ShardSettings(param_dtype=dtype))
        return cls(ModelRunner(model, par, dtype=dtype, balance_batch=balance_batch,
                               remove_padding=rm.model.use_remove_padding), rm, tokenizer=tokenizer,
                   input_tokenizer=input_tokenizer)

    def encode(self, batch: Batch) -> list[list[int]]:
        """The reward model's ids for each row: the prompt's chat (`raw_prompt`; without it the decoded prompt as
        one user turn) and the decoded response (all of it: a multi-turn episode's tool results too)."""
        dec = self.input_tokenizer
        responses = dec.batch_decode([r[m.bool()].tolist() for r, m in zip(batch["responses"],
                                                                           response_attention(batch))],
                                     skip_special_tokens=True)
        chats = batch.meta.get("raw_prompt") or [None] * len(batch)
        out = []
        for i, (chat, response) in enumerate(zip(chats, responses)):
            if chat is None:
                prompt = batch["prompts"][i][batch["prompt_mask"][i].bool()].tolist()
                chat = [{"role": "user", "content": dec.decode(prompt, skip_special_tokens=True)}]
            out.append(rm_input_ids(self.tokenizer, list(chat), response, self.cfg.max_length))
        return out

    @torch.no_grad()
    def score(self, batch: Batch) -> torch.Tensor:
        """(B,) float32: the classifier's output at the last real token of each row's re-encoded exchange."""
        ids = self.encode(batch)
        n, width = len(ids), max([len(x) for x in ids] + [1])
        input_ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, row in enumerate(ids):  # right padding: positions 0.. of every row are its real tokens
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        cfg = self.cfg
        packed = self.packs()
        parts = self.runner.micro_parts(Batch({"attention_mask": mask}), cfg.micro_batch_size_per_gpu,
                                        max_tokens=cfg.forward_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
                                        packed=packed)
        forward = self._packed_forward if packed else self._forward
        scores = torch.zeros(n, dtype=torch.float32)
        with eval_mode(self.model):
            for part in parts:
                if not part:  # this rank has fewer rows than micro-batches: a sharded model still joins the pass
                    forward(input_ids[:1, :1], torch.ones((1, 1), dtype=torch.long))
                    continue
                w = int(mask[part].sum(-1).max())
                scores[part] = forward(input_ids[part, :w], mask[part, :w])
        return scores

    def packs(self) -> bool:
        """Whether micro-batches run packed (`model.use_remove_padding`, models/packed.py): asked for, a head
        that scores every position, and once a check that packed rows get the padded rows' scores."""
        if self.packed_ok is None:
            self.packed_ok = bool(self.runner.remove_padding and self.head is not None)
            if self.packed_ok:
                pad = self.model.config.pad_token_id

                def padded_rows(run):
                    return lambda ids, mask, L: run(*right_padded(ids, mask, pad))

                self.packed_ok = switch_on_if_equal(self.model, self.model.config, padded_rows(self._forward),
                                                    padded_rows(self._packed_forward), "scores", packed=True)
        return self.packed_ok

    def _packed_forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`_forward`'s scores with the rows packed: the head's output at each row's last real token."""
        rows = pack(ids.to(self.runner.device), mask.to(self.runner.device))
        captured = {}
        hook = self.head.register_forward_hook(lambda m, i, o: captured.setdefault("logits", o))
        try:
            kwargs = {"use_cache": False} if hasattr(self.model.config, "use_cache") else {}
            with self.runner.autocast(), mask_off():
                self.model(input_ids=rows.input_ids, position_ids=rows.position_ids, packed=rows.packing, **kwargs)
        finally:
            hook.remove()
        ends = torch.tensor(rows.packing.bounds[1:], device=rows.input_ids.device) - 1
        return captured["logits"][0, ends, 0].float().cpu()

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        captured = {}
        hook = self.head.register_forward_hook(lambda m, i, o: captured.setdefault("logits", o)) if self.head else None
        try:
            kwargs = {"use_cache": False} if hasattr(self.model.config, "use_cache") else {}
            with self.runner.autocast():
                out = self.model(input_ids=ids.to(self.runner.device), attention_mask=mask.to(self.runner.device),
                                 **kwargs)
        finally:
            if hook is not None:
                hook.remove()
        if captured.get("logits") is None or captured["logits"].dim() != 3:  # the classifier's own pooling
            return out.logits[:, 0].float().cpu()
        logits = captured["logits"][..., 0].float().cpu()  # (b, T): the score the head gives every position
        return logits[torch.arange(len(ids)), mask.sum(-1) - 1]
