"""What runs inside vLLM's worker: new weights by Hugging Face name, loaded in place (`worker_extension_cls`).

vLLM mixes this class into its worker and calls its methods by name (`LLM.collective_rpc`); no callable is pickled.
posttrain runs vLLM's worker in the training process (executor `uni`, or `external_launcher` under torchrun), so
the weights arrive as the tensors themselves, produced lazily by the trainer's iterator, bucket by bucket.

Loading goes through vLLM's own `reload_weights` (the model's `load_weights`: fused projections such as `qkv_proj`
are filled from `q_proj`/`k_proj`/`v_proj`, each layer's kernels re-packed once its weights are in). One trap is
closed here: an output head tied to the input embedding receives no weights of its own, so its processing step does
not run again; on CPU that step packs the weight for the GEMM kernel, and the head would keep computing logits with a
packed copy of the *old* embedding while the layers below run on the new weights. Every tied head is pointed at its
embedding's weight again and re-processed after each load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class TrainerWeights:
    """The methods vLLM's worker gains (its `model_runner` is the worker's)."""

    def load_trainer_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load `weights` ((name, tensor) pairs by the Hugging Face names, whole tensors; vLLM cuts its own
        tensor-parallel pieces) into the running model; returns how many tensors were loaded."""
        model = self.model_runner.get_model()
        tied = _tied_heads(model)
        count = 0

        def counted():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        from .launch import quiet

        # quiet: the layers that take no weights of their own (rotary tables, a tied head) are reported as failed
        with quiet("vllm.model_executor.model_loader.reload.layerwise"):
            self.model_runner.reload_weights(weights_iterator=counted())
        for head, embedding in tied:
            head.weight = embedding.weight
            head.quant_method.process_weights_after_loading(head)
        return count


def _tied_heads(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(output head, embedding) pairs whose weight is one tensor (`tie_word_embeddings`)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)
                  and not isinstance(m, ParallelLMHead)]
    pairs = []
    for head in model.modules():
        if isinstance(head, ParallelLMHead):
            for embedding in embeddings:
                if head.weight is embedding.weight:
                    pairs.append((head, embedding))
    return pairs
