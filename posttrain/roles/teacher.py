"""The teachers of on-policy distillation: frozen models placed like the reference (sharded over the training
processes), computing in the rollout's dtype, that score the student's sampled responses token by token."""

from __future__ import annotations

import torch

from ..data.batch import Batch
from ..errors import ConfigError
from ..models.load import eval_mode
from .reference import Reference

TEACHER_TEMPERATURE = 1.0  # the teacher's own distribution, whatever the student sampled with


def teacher_rows(student_tok, teacher_tok, student_vocab: int, teacher_vocab: int, key: str) -> int | None:
    """How much of the teacher's output head scores the student's tokens: None (all of it: the same size) or
    `student_vocab`, for a teacher whose embedding is padded beyond the student's (Qwen2.5-7B's 152064 rows
    teaching Qwen2.5-1.5B's 151936): its rows past the student's are cut off before it scores, so its
    distribution is over the student's vocabulary. The teacher scores the student's token ids, so the two
    tokenizers must be one (the same token for every id, the same special tokens): a ConfigError names the first
    difference, or a teacher with fewer rows than the student (the student can sample ids it has no row for)."""
    difference = tokenizer_difference(student_tok, teacher_tok)
    if difference is not None:
        raise ConfigError(f"{key}: the teacher's tokenizer differs from the student's ({difference}); the teacher "
                          "scores the student's token ids, so both must use one tokenizer")
    if teacher_vocab < student_vocab:
        raise ConfigError(f"{key}: the teacher's embedding has {teacher_vocab} rows, fewer than the student's "
                          f"{student_vocab}: the student can sample ids the teacher has no row for")
    return student_vocab if teacher_vocab > student_vocab else None


def tokenizer_difference(a, b) -> str | None:
    """The first difference between two tokenizers' id mappings and special tokens, in words (None: the same)."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        only_a, only_b = sorted(set(va) - set(vb)), sorted(set(vb) - set(va))
        moved = sorted(t for t in set(va) & set(vb) if va[t] != vb[t])
        parts = [f"{len(va)} and {len(vb)} tokens"]
        parts += [f"the student's has {only_a[:3]} the teacher's lacks"] if only_a else []
        parts += [f"the teacher's has {only_b[:3]} the student's lacks"] if only_b else []
        parts += [f"{moved[:3]} have other ids"] if moved else []
        return "; ".join(parts)
    special = lambda tok: {i: t.content for i, t in tok.added_tokens_decoder.items() if t.special}  # noqa: E731
    sa, sb = special(a), special(b)
    if sa != sb:
        ids = sorted(set(sa.items()) ^ set(sb.items()))[:3]
        return f"other special tokens: {ids}"
    return None


class Teachers:
    """One or more teachers; each row is scored by the teacher whose `key` equals the row's `teacher_key` field
    (one teacher: every row). `topk` > 0: each position's top-k log-probs and ids instead of the sampled token's."""

    def __init__(self, runners: dict, keys: dict, ref_cfg, *, teacher_key: str, topk: int = 0):
        self.teachers = {name: Reference(runner, ref_cfg, temperature=TEACHER_TEMPERATURE)
                         for name, runner in runners.items()}
        self.keys, self.teacher_key, self.topk = keys, teacher_key, topk

    def rows_of(self, batch: Batch) -> dict[str, list[int]]:
        """Each teacher's rows; a row that names no teacher is an error (every rank sees the same batch)."""
        if len(self.teachers) == 1:
            return {next(iter(self.teachers)): list(range(len(batch)))}
        values = batch.meta.get(self.teacher_key)
        if values is None:
            raise KeyError(f"distillation.teacher_key={self.teacher_key!r}: the rows carry no such field")
        by_key = {key: name for name, key in self.keys.items()}
        missing = sorted({str(v) for v in values} - set(by_key))
        if missing:
            raise KeyError(f"rows with {self.teacher_key}={missing} have no teacher (teacher keys: {sorted(by_key)})")
        rows: dict[str, list[int]] = {name: [] for name in self.teachers}
        for i, value in enumerate(values):
            rows[by_key[str(value)]].append(i)
        return rows

    @torch.no_grad()
    def score(self, batch: Batch) -> dict[str, torch.Tensor]:
        """`teacher_log_probs` (B, L): the teacher's log-prob of each sampled token; with top-k,
        `teacher_topk_log_probs` / `teacher_topk_ids` (B, L, k) instead. Each teacher runs over the whole batch
        (every rank's share, so that the collective passes line up) and its rows are kept."""
        out: dict[str, torch.Tensor] = {}
        for name, rows in self.rows_of(batch).items():
            scored = self._score_one(self.teachers[name], batch)
            for key, value in scored.items():
                if key not in out:
                    out[key] = torch.zeros_like(value)
                out[key][rows] = value[rows]
        return out

    def _score_one(self, ref: Reference, batch: Batch) -> dict[str, torch.Tensor]:
        k, cfg = self.topk, ref.cfg

        def compute(mb):
            if not k:
                logp, _ = ref.runner.logprobs(mb, temperature=TEACHER_TEMPERATURE, with_entropy=False)
                return (logp,)
            _, _, (top_lp, top_ids) = ref.runner.logprobs(mb, temperature=TEACHER_TEMPERATURE, with_entropy=False,
                                                          extra_tokens=k)
            return top_lp.flatten(1), top_ids.flatten(1)  # (b, L * k): per_row gathers 2-D rows

        with ref._weights(), eval_mode(ref.model):
            out = ref.runner.per_row(batch, compute, micro_batch_size=cfg.log_prob_micro_batch_size_per_gpu,
                                     max_tokens=cfg.log_prob_max_token_len_per_gpu
                                     if cfg.log_prob_use_dynamic_bsz else None)
        if not k:
            return {"teacher_log_probs": out[0]}
        B = len(batch)
        return {"teacher_topk_log_probs": out[0].view(B, -1, k), "teacher_topk_ids": out[1].view(B, -1, k)}
