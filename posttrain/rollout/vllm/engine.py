"""`rollout.name=vllm`: a `RolloutEngine` over vLLM's offline engine, colocated with the trainer (verl's hybrid engine).

Every training process holds one vLLM engine whose worker runs in the process itself: executor `uni` in a
one-process run; under torchrun vLLM's `external_launcher`, which makes tensor-parallel groups of
`tensor_model_parallel_size` consecutive ranks of the torchrun world (each group generates its members' prompts
together; groups generate independently). Before a generate call whose weights changed, the trainer's weights go into
vLLM bucket by bucket (trainer_weights.py, worker.py) and vLLM's prefix cache is emptied, so no key computed under
old weights is read again. Token ids go in, token ids and each sampled token's log-prob (of the distribution it was
drawn from) come out. docs/rollout_engines.md says which engine when.
"""

from __future__ import annotations

import contextlib
import time

import torch

from ...data.batch import Batch
from ...models.vision import MM_KEY, is_vision_config
from ...parallel.context import gather_in, joined_world
from ..base import RolloutEngine, SamplingParams
from .launch import check_head_size, free_segment_names, start_llm, tensor_parallel_group
from .settings import EngineSettings
from .trainer_weights import trainer_weights, weights_fingerprint


class VLLMEngine(RolloutEngine):
    """generate(batch, sampling) as `RolloutEngine` says, on vLLM (see the module docstring)."""

    decodes_policy_weights = False  # vLLM holds its own copy: the trainer's sharded policy is not gathered around it

    def __init__(self, model, tokenizer, *, device, dtype, micro_batch_size: int | None = None,
                 settings: EngineSettings):
        super().__init__(model, tokenizer, device=device, dtype=dtype, micro_batch_size=micro_batch_size)
        if is_vision_config(model.config):
            raise ValueError("actor_rollout_ref.rollout.name=vllm: vision-language models are not supported by the "
                             "vLLM engine here (prompts carry no images to it); use rollout.name=posttrain")
        check_head_size(model.config, torch.device(device).type)
        self.settings = settings
        self.distributed = joined_world() > 1
        self.llm = start_llm(settings, device_type=torch.device(device).type, distributed=self.distributed)
        self.sleeps = settings.sleeps(torch.device(device).type)
        self.group = tensor_parallel_group() if settings.tensor_parallel_size > 1 else None
        free_segment_names()
        self.held = None  # the fingerprint of the trainer's weights vLLM holds (None: vLLM's own load)
        self.weights_version = 0  # pushes so far (0: the weights vLLM loaded itself)
        self.push_seconds = 0.0  # the last push's
        self._awake_held = False  # inside `kept_awake`: generate calls neither wake nor put the engine to sleep
        if self.sleeps:  # asleep until the first generate call: the trainer has the device's memory
            self.llm.sleep(level=1)

    # ------------------------------------------------------------------ weights

    def sync_weights(self) -> bool:
        """The trainer's weights into vLLM if they changed since the last push (every rank together: a sharded
        policy is gathered by collectives); its prefix cache emptied. Returns whether weights were pushed."""
        fingerprint = weights_fingerprint(self.model)
        if fingerprint == self.held:
            return False
        start = time.perf_counter()
        self.llm.collective_rpc("load_trainer_weights",
                                args=(trainer_weights(self.model, self.settings.bucket_bytes, self.settings.dtype),))
        self.llm.reset_prefix_cache()
        self.held, self.weights_version = fingerprint, self.weights_version + 1
        self.push_seconds = time.perf_counter() - start
        return True

    @contextlib.contextmanager
    def _awake(self):
        """free_cache_engine on a GPU: vLLM sleeps between generate calls (weights to CPU memory, KV cache freed)
        and wakes for them: its weights first, then (after any push) its KV cache."""
        if self._awake_held:  # awake already, weights pushed when it woke
            yield
            return
        if not self.sleeps:
            self.sync_weights()
            yield
            return
        self.llm.wake_up(tags=["weights"])
        try:
            self.sync_weights()
            self.llm.wake_up(tags=["kv_cache"])
            yield
        finally:
            self.llm.sleep(level=1)

    @contextlib.contextmanager
    def kept_awake(self):
        """Several generate calls as one (the turns of multi-turn episodes): the weights pushed once, and with
        free_cache_engine no sleep between the calls, since sleeping frees the KV cache and with it the prefix cache
        each next turn's conversations (the previous turn's plus its new tokens) are read from."""
        if self._awake_held:
            yield
            return
        with self._awake():
            self._awake_held = True
            try:
                yield
            finally:
                self._awake_held = False

    # ------------------------------------------------------------------ generation

    def ready(self) -> None:
        """A rank with no rows to generate, where the others call `generate`: it pushes weights with them and
        takes part in its tensor-parallel group's generation."""
        with self._awake():
            self._requests([], 0, None)

    @torch.no_grad()
    def generate(self, batch: Batch, sampling: SamplingParams) -> Batch:
        if batch.meta.get(MM_KEY) is not None:
            raise ValueError("rollout.name=vllm: prompts with images are not supported by the vLLM engine here")
        out = batch.repeat_interleave(sampling.n)
        prompts = [row[mask.bool()].tolist() for row, mask in zip(batch["prompts"], batch["prompt_mask"])]
        if self.between_steps is not None:
            raise NotImplementedError("rollout.name=vllm: vLLM runs each generate call to its end on one weight "
                                      "version; partial rollouts (weights swapped between decoding steps) run on "
                                      "posttrain's engine")
        seed = int(torch.randint(0, 2**62, (1,)))  # from torch's generator, which the trainer seeds per step and rank
        with self._awake():
            samples = self._requests(prompts, seed, sampling)
        width = max([len(tokens) for tokens, _ in samples] + [1])
        responses = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
        for i, (tokens, lps) in enumerate(samples):
            responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[i, :len(tokens)] = 1
            if lps is not None:
                logprobs[i, :len(tokens)] = torch.tensor(lps, dtype=torch.float32)
        out["responses"], out["response_mask"] = responses, mask
        if sampling.logprobs:
            out["rollout_log_probs"] = logprobs
        out["input_ids"] = torch.cat([out["prompts"], responses], dim=1)
        out["attention_mask"] = torch.cat([out["prompt_mask"], mask], dim=1)
        return out

    def _requests(self, prompts: list[list[int]], seed: int, sampling: SamplingParams | None
                  ) -> list[tuple[list[int], list[float] | None]]:
        """This rank's prompts sampled `n` times each: (tokens, log-probs) per sample, prompt by prompt. In a
        tensor-parallel group every member generates the prompts of all, each with its owner's seed (each keeps its
        own samples)."""
        mine = (prompts, seed, sampling)
        everyone, me = ([mine], 0) if self.group is None else gather_in(self.group, mine)
        results = []
        for part_prompts, part_seed, part_sampling in everyone:
            samples = self._sample(part_prompts, part_seed, part_sampling) if part_prompts else []
            results.append(samples)
        return results[me]

    def _sample(self, prompts: list[list[int]], seed: int, s: SamplingParams):
        """vLLM samples with torch's generator of this process (its worker runs here), seeded with `seed` for the
        call and restored after: per-request seeds would be vLLM's other way, but its CPU worker fails on them when
        a prompt's prefill is split over steps (it rewinds the generator, which a CPU generator cannot)."""
        from vllm import SamplingParams as VSampling

        # vLLM's stops are exactly posttrain's EOS ids (its own EOS check is off: ignore_eos); greedy decoding takes
        # n=1 only, so a greedy prompt is sent n times
        stops = [] if s.ignore_eos else sorted(self.eos_ids)
        copies, n = (s.n, 1) if s.greedy else (1, s.n)
        chunk = self.micro_batch_size or len(prompts)
        samples = []
        for start in range(0, len(prompts), chunk):
            params = [VSampling(n=n, temperature=0.0 if s.greedy else s.temperature,
                                top_p=1.0 if s.greedy else s.top_p, top_k=0 if s.greedy or s.top_k < 1 else s.top_k,
                                max_tokens=s.max_new_tokens, ignore_eos=True, stop_token_ids=stops,
                                logprobs=0 if s.logprobs else None, detokenize=False)
                      for _ in range(len(prompts[start:start + chunk]) * copies)]
            requests = [{"prompt_token_ids": p} for p in prompts[start:start + chunk] for _ in range(copies)]
            devices = [torch.cuda.current_device()] if torch.device(self.device).type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed + start)
                done = self.llm.generate(requests, params, use_tqdm=False)
            for request in done:
                for completion in request.outputs:
                    lps = None
                    if s.logprobs:
                        lps = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
                    samples.append((list(completion.token_ids), lps))
        return samples
