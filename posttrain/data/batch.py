"""`Batch`: the one object a training step passes between stages — tensors with batch dim = responses, plus
per-response Python fields (uid, data_source, ground_truth, ...). A stage reads the keys it needs and adds its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor


@dataclass
class Batch:
    tensors: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        for value in self.tensors.values():
            return value.shape[0]
        for value in self.meta.values():
            return len(value)
        return 0

    def __getitem__(self, key: str) -> Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: Tensor) -> None:
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def select(self, index: Sequence[int] | Tensor) -> "Batch":
        """Rows `index` of every field, in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        rows = idx.tolist()
        return Batch({k: v[idx] for k, v in self.tensors.items()}, {k: [v[i] for i in rows] for k, v in self.meta.items()})

    def repeat_interleave(self, n: int) -> "Batch":
        return self.select(torch.arange(len(self)).repeat_interleave(n))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all `batches` in order. Meta keys are the union over the batches (a reward function's extra keys
        exist only where some row returned them: other ranks, other DAPO rounds); a row without a key holds None."""
        first = batches[0]
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        keys = dict.fromkeys(k for b in batches for k in b.meta)
        meta = {k: [x for b in batches for x in b.meta.get(k, [None] * len(b))] for k in keys}
        return Batch(tensors, meta)

    def get(self, key: str, default: Any = None) -> Any:
        return self.tensors.get(key, self.meta.get(key, default))


def response_attention(batch: Batch) -> Tensor:
    """(B, L) 1 on every real response token, 0 on right padding. A multi-turn batch holds it as
    `response_attention_mask` (its `response_mask` is 1 on the policy's tokens only, with holes where tool results
    and other appended tokens are); in a single-turn batch every real token is the policy's, so it is
    `response_mask`. What scorers read, what a forward attends to and what counts as the response's length."""
    return batch.tensors.get("response_attention_mask", batch["response_mask"])
