"""The generative judge (`reward_model.judge.enable=True`): a causal LM that answers a prompt about each response.

Placed like the reference: frozen, loaded in the rollout's compute dtype (in one process) or FSDP2-sharded with that
dtype as its mixed precision (several processes, built with the same `prepare_model`). Its answers are decoded by
posttrain's rollout engine (`DecodeEngine`: batched, KV-cached, the prompt prefilled once), greedily unless a
temperature is set. A sharded judge is gathered once per call (as the policy is for generation), so each rank
then decodes its own prompts without collectives, except the engine's one-time check, which the ranks agree on;
every rank must therefore call `verdicts`, also with no prompts.
The verdicts become rewards in reward/judge.py.
"""

from __future__ import annotations

import torch

from ..data.batch import Batch
from ..models.load import compute_dtype, load_causal_lm, load_tokenizer
from ..models.policy import PolicyModel
from ..parallel import Parallel, ShardSettings, gathered_for_generation, prepare_model
from ..rollout.base import SamplingParams
from ..rollout.engine import DecodeEngine


def judge_sampling(judge_cfg) -> SamplingParams:
    """Greedy at temperature 0 (the default), else sampled with the configured temperature / top_p / top_k."""
    return SamplingParams(n=1, do_sample=judge_cfg.temperature > 0, temperature=judge_cfg.temperature or 1.0,
                          top_p=judge_cfg.top_p, top_k=judge_cfg.top_k, max_new_tokens=judge_cfg.response_length)


class Judge:
    def __init__(self, model, tokenizer, *, device: torch.device, dtype: torch.dtype, sampling: SamplingParams,
                 use_chat_template: bool = True, micro_batch_size: int | None = None):
        self.model, self.tokenizer, self.sampling = model.eval().requires_grad_(False), tokenizer, sampling
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.engine = DecodeEngine(model, tokenizer, device=device, dtype=dtype, micro_batch_size=micro_batch_size)

    @classmethod
    def from_config(cls, cfg, par: Parallel) -> "Judge":
        """`reward_model.*` of `cfg`: the judge is `reward_model.model.path`, a causal LM."""
        rm = cfg.reward_model
        dtype = compute_dtype(cfg.actor_rollout_ref.rollout.dtype, par.device)
        trust, key = rm.model.trust_remote_code, "reward_model.model.path"
        tokenizer = load_tokenizer(rm.model.path, trust, key=key)

        def build(meta: bool):
            # stored in the compute dtype when not sharded: a frozen model needs no float32 master weights, and
            # decoding then runs on them as they are
            stored = torch.float32 if par.distributed else dtype
            return PolicyModel(load_causal_lm(rm.model.path, meta=meta, dtype=stored, trust_remote_code=trust,
                                              key=key))

        model = prepare_model(build, par, ShardSettings(param_dtype=dtype))
        return cls(model, tokenizer, device=par.device, dtype=dtype, sampling=judge_sampling(rm.judge),
                   use_chat_template=rm.judge.use_chat_template, micro_batch_size=rm.micro_batch_size_per_gpu)

    def encode(self, prompt: str) -> list[int]:
        """The judge's ids for one prompt: a user turn in its chat template, ready for the answer (without a chat
        template or with `use_chat_template=False`: the text as it is, with the tokenizer's special tokens)."""
        if self.use_chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(prompt)["input_ids"]

    @torch.no_grad()
    def verdicts(self, prompts: list[str]) -> list[str]:
        """The judge's answer to each prompt, decoded without special tokens."""
        with gathered_for_generation(self.model):
            if not prompts:
                self.engine.ready()  # the engine's one-time check is a collective for a sharded judge
                return []
            ids = [self.encode(p) for p in prompts]
            width = max(len(x) for x in ids)
            pad = self.engine.pad_id
            tokens = torch.full((len(ids), width), pad, dtype=torch.long)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for i, row in enumerate(ids):  # left padding, as the rollout engine expects
                tokens[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
                mask[i, width - len(row):] = 1
            out = self.engine.generate(Batch({"prompts": tokens, "prompt_mask": mask}), self.sampling)
        return self.tokenizer.batch_decode([r[m.bool()].tolist() for r, m in zip(out["responses"],
                                                                                 out["response_mask"])],
                                           skip_special_tokens=True)
