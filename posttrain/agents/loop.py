"""The episode loop: every live episode decodes in one batch; one that ends its turn leaves the batch while its
environment answers (tools run in worker threads), and comes back with its keys and values kept — only the appended
tokens are computed. A slow tool delays only its own episode.

Token-in / token-out: the policy's sampled tokens are kept as sampled; appended messages are tokenized alone (the
chat template's rendering of them after an assistant turn, template.py). An episode ends on a turn its environment
answers with `done` (the tool agent: a turn without a tool call), at `max_assistant_turns` assistant turns or after
`max_user_turns` environment rounds (verl's count: each answer that appends messages, tool results or a user turn, is
one), when its environment fails or the template cannot render its answer (counted), or at the response budget
(`data.max_response_length`: every token after the prompt, policy and appended alike; `truncated`).

A vision-language row's episode (its image inputs in the row, MM_KEY) decodes on the turn-by-turn path: each turn
re-prefills the conversation with its images (the vision tower included), since the parking loop's prefill of
appended tokens and its shared-prefix step do not drive the model's image inputs and 3-D positions. Appended
messages stay text; an answer whose rendering holds vision tokens ends its episode (a template error, counted).

An engine that holds weights of its own and only generates (vLLM: `decodes_policy_weights` False) runs the
turn-by-turn loop through its `generate`: each turn the live conversations go to it as token ids (prompt and every
token so far, none re-tokenized) and their turns come back as token ids with their log-probs; its prefix cache
serves the part of each conversation an earlier turn computed. The trainer's policy is not gathered for it.

Environment steps run in daemon threads: one past its time limit is abandoned and never keeps the process from
exiting (a thread pool would join it at exit). Under tensor parallel an episode's environment runs once, on the
first process of the group, and the others receive its answers (the group must append the same tokens).

`Episode.versions` (partial rollouts): for each policy token, the oldest weight version whose keys and values it
attended to — the version that prefilled the episode's context (in the turn-by-turn loop, each turn's) — so the
staleness metrics count what a token saw, not the newer weights a swap put in before its own forward.

`run_episodes` turns a batch of prompts into the multi-turn batch the trainer consumes (docs/agents.md: `responses`
holds every token after the prompt, `response_mask` is 1 on policy tokens only, `response_attention_mask` 1 on every
real token).
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import logging
import threading
import time
from typing import Callable

import torch

from ..data.batch import Batch
from ..models.load import attention_backends, autocast, eval_mode
from ..models.vision import MM_KEY, is_vision_config, vision_token_ids
from ..parallel.shard import from_tensor_parallel_first, tensor_parallel, tensor_parallel_first
from ..rollout.base import SamplingParams
from ..rollout.sampling import next_tokens, sampled_logprobs
from ..rollout.weights import inference_weights
from .environment import ENVIRONMENTS, Environment, Step
from .episode import Episode
from .settings import AgentSettings
from .template import Template, TemplateError, encode_start, full_render

POLL_S = 0.005  # how long the loop waits for an environment when no episode is decoding
log = logging.getLogger(__name__)


def environment_for(row: dict, settings: AgentSettings) -> Environment:
    """The row's environment: its `agent_name`, else `rollout.agent.default_agent_loop`."""
    name = row.get("agent_name") or settings.default_agent_loop
    if name not in ENVIRONMENTS:
        raise ValueError(f"agent_name={name!r}: no such environment (known: {', '.join(sorted(ENVIRONMENTS))})")
    return ENVIRONMENTS[name](settings)


class EpisodeRunner:
    """Runs episodes on an engine. `environments(row) -> Environment` (default: `environment_for`)."""

    def __init__(self, engine, tokenizer, settings: AgentSettings,
                 environments: Callable[[dict], Environment] | None = None):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.environments = environments or (lambda row: environment_for(row, settings))
        self.template = Template(tokenizer, engine.eos_ids, settings.template_kwargs, format=settings.format)
        config = engine.model.config
        self._vision = set(vision_token_ids(config)) if is_vision_config(config) else set()

    # ------------------------------------------------------------------ the run

    def run(self, rows: list[dict], n: int, sampling: SamplingParams, *, continuous: bool = True) -> list[Episode]:
        """`n` episodes per row (consecutive), each decoding up to `sampling.max_new_tokens` tokens after its
        prompt. `continuous=False` runs the plain loop instead: each turn re-prefills every conversation and waits
        for the slowest episode (what the benchmark compares with; also the path of engines that cannot park, of a
        tensor-parallel model, whose processes must decode the same rows in the same order, and of rows with
        images). An engine that only generates (`decodes_policy_weights` False: vLLM, which holds its own copy of
        the weights) runs turn by turn through its `generate`, kept awake across the turns."""
        engine, self._budget = self.engine, sampling.max_new_tokens
        self._tp = tensor_parallel(engine.model)  # the group's first process runs the environments, once
        each = [row for row in rows for _ in range(n)]
        envs, starts = self._reset(each)
        pool = StepThreads(max(1, self.settings.num_workers))
        try:
            episodes = [Episode(prompt_ids=encode_start(self.tokenizer, start.messages, start.tools,
                                                        self.settings.template_kwargs, images=row.get(MM_KEY),
                                                        config=engine.model.config),
                                messages=[dict(m) for m in start.messages], row=row, tools=start.tools,
                                images=row.get(MM_KEY))
                        for row, start in zip(each, starts)]
            if getattr(engine, "decodes_policy_weights", True):
                self._decode(episodes, envs, n, sampling, pool, continuous=continuous)
            else:  # an engine with weights of its own (vLLM): turn by turn through its generate, kept awake
                with getattr(engine, "kept_awake", contextlib.nullcontext)():
                    self._turn_by_turn(self._generated, episodes, envs, sampling, pool)
        finally:
            pool.close()
            for env in envs:
                _close(env)
        return episodes

    def _decode(self, episodes, envs, n, sampling, pool, *, continuous: bool) -> None:
        """The episodes on posttrain's engine, which decodes with the policy's own modules (gathered when sharded):
        the parking loop where it can, else turn by turn."""
        engine = self.engine
        with inference_weights(engine.model, engine.dtype) as model, \
                attention_backends(torch.device(engine.device)):
            engine.prepare(model)
            # a tensor-parallel group decodes in lockstep (its forwards are collectives), but the continuous
            # loop's batch changes as environments happen to answer, which differs between the group's processes
            parks = (continuous and getattr(engine, "shared_prefix_ok", False) and hasattr(engine, "park")
                     and not tensor_parallel(model) and all(e.images is None for e in episodes))
            with eval_mode(model), torch.no_grad(), autocast(engine.device, engine.dtype):
                generator = (None if sampling.greedy else
                             torch.Generator(engine.device).manual_seed(int(torch.randint(0, 2**62, (1,)))))
                if parks:
                    self._continuous(model, episodes, envs, n, sampling, generator, pool)
                else:
                    self._turn_by_turn(lambda ids, mask, s, images: engine.decode(model, ids, mask, s,
                                                                                  images=images),
                                       episodes, envs, sampling, pool)

    def _reset(self, rows: list[dict]) -> tuple[list, list]:
        """Each row's environment and its `reset`; under tensor parallel made on the group's first process only
        (the others hold None and receive the resets, or the error that stopped them)."""
        envs, starts, error = [], [], None
        if tensor_parallel_first(self.engine.model):
            try:
                for row in rows:
                    envs.append(self.environments(row))
                    starts.append(envs[-1].reset(row))
            except Exception as e:  # noqa: BLE001 - raised below, on every process of the group alike
                error = e
        if self._tp:
            starts, message = from_tensor_parallel_first(
                (starts, None if error is None else f"{type(error).__name__}: {error}"), self.engine.model)
            if message is not None and error is None:
                raise RuntimeError(f"the environments of the tensor-parallel group's first process failed to "
                                   f"start: {message}")
        if error is not None:
            for env in envs:
                _close(env)
            raise error
        return envs or [None] * len(rows), starts

    def _continuous(self, model, episodes, envs, n, sampling, generator, pool) -> None:
        engine, budget = self.engine, sampling.max_new_tokens
        shared = all(episodes[i].prompt_ids == episodes[i - i % n].prompt_ids for i in range(len(episodes)))
        firsts = episodes[::n] if shared else episodes
        ids, mask = _left_padded([e.prompt_ids for e in firsts], engine.pad_id)
        seen = self._version(model)  # the prompts' keys: the oldest weights every later token attends to
        logits, state = engine.start(model, ids, mask, n if shared else 1, budget, share_prefix=False)
        turn: dict[int, tuple[list[int], list[float], list[int]]] = {i: ([], [], []) for i in range(len(episodes))}
        waiting: dict[futures.Future, tuple[int, object, float]] = {}  # future -> (episode, parked past, start)
        with engine.decoding(model):
            while len(state.ids) or waiting:
                if len(state.ids):
                    token = next_tokens(logits, sampling, generator)
                    lps = sampled_logprobs(logits, token, sampling).tolist() if sampling.logprobs else None
                    ended, kept = [], []
                    for j, (e, t) in enumerate(zip(state.ids.tolist(), token.tolist())):
                        tokens, logprobs, versions = turn[e]
                        tokens.append(t)
                        logprobs.append(lps[j] if lps is not None else 0.0)
                        versions.append(seen)
                        full = len(episodes[e].tokens) + len(tokens) >= budget
                        (ended if t in engine.eos_ids or full else kept).append(j)
                    if ended:
                        for j in ended:
                            e = int(state.ids[j])
                            if self._end_turn(episodes[e], *turn.pop(e)):
                                waiting[pool.submit(envs[e].step, episodes[e])] = (e, state.past(j),
                                                                                   time.monotonic())
                            turn[e] = ([], [], [])
                        keep = torch.tensor(kept, dtype=torch.long, device=state.ids.device)
                        state.keep(keep)
                        logits, token = logits[keep], token[keep]
                    if len(state.ids):
                        self._version(model)
                        logits = engine.step(model, state, token)
                if waiting:
                    idle = not len(state.ids)
                    done, _ = futures.wait(list(waiting), timeout=POLL_S if idle else 0,
                                           return_when=futures.FIRST_COMPLETED)
                    now = time.monotonic()
                    late = [f for f in waiting if f not in done and now - waiting[f][2] > self.settings.step_timeout_s]
                    back = []
                    for f in list(done) + late:
                        e, past, _ = waiting.pop(f)
                        appended = self._answer(episodes[e], _outcome(f))
                        if appended is not None:
                            last = episodes[e].tokens[-len(appended) - 1]  # the turn's end token, not in `past`
                            back.append((e, past, torch.tensor([last] + appended)))
                    if back:  # the episodes whose environments answered rejoin together: one forward
                        self._version(model)
                        more = engine.resume_many(model, state, back,
                                                  max(budget - len(episodes[e].tokens) for e, _, _ in back))
                        logits = torch.cat([logits, more.to(logits.dtype)])
        for ep in episodes:
            ep.done = True

    def _turn_by_turn(self, decode, episodes, envs, sampling, pool) -> None:
        """Each turn: every live conversation re-prefilled and decoded together by `decode(ids, mask, sampling,
        images) -> (tokens, log-probs, versions)` (posttrain's engine on the decoding weights, or `_generated`); then
        every environment step; the next turn starts when the slowest one has answered."""
        engine, budget = self.engine, sampling.max_new_tokens
        live = list(range(len(episodes)))
        while live:
            room = max(budget - len(episodes[e].tokens) for e in live)
            ids, mask = _left_padded([episodes[e].prompt_ids + episodes[e].tokens for e in live], engine.pad_id)
            s = SamplingParams(n=1, do_sample=sampling.do_sample, temperature=sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=room,
                               logprobs=sampling.logprobs)
            images = [episodes[e].images for e in live]
            tokens, logprobs, step_versions = decode(ids, mask, s, images if any(i is not None for i in images)
                                                     else None)
            steps = {}
            for j, e in enumerate(live):
                own = tokens[j, : budget - len(episodes[e].tokens)].tolist()
                stop = next((i for i, t in enumerate(own) if t in engine.eos_ids), None)
                own = own if stop is None else own[: stop + 1]
                lps = logprobs[j, : len(own)].tolist() if logprobs is not None else None
                versions = step_versions[:1] * len(own) if step_versions else None  # the turn's prefill's
                if self._end_turn(episodes[e], own, lps, versions):
                    steps[e] = None
            outcomes = self._step_all(steps, episodes, envs, pool)
            live = [e for e in steps if self._answer(episodes[e], outcomes[e]) is not None]
        for ep in episodes:
            ep.done = True

    def _generated(self, ids: torch.Tensor, mask: torch.Tensor, s: SamplingParams, images: list | None):
        """One turn on an engine that holds weights of its own and only generates (vLLM): the conversations go to
        its `generate` as token ids and their turns come back as token ids, with each token's log-prob, cut after
        the first EOS by the caller (a row runs to its EOS or to `s.max_new_tokens`: its padding lies after its
        EOS). Every token is sampled with the weights the engine holds (`weights_version`); the prefix cache serves
        the conversation the previous turn already computed."""
        if images is not None:  # a vision-language model is refused when such an engine is built
            raise ValueError(f"{type(self.engine).__name__} does not decode image inputs; use rollout.name=posttrain")
        out = self.engine.generate(Batch({"prompts": ids, "prompt_mask": mask}), s)
        return out["responses"], out.get("rollout_log_probs"), [int(getattr(self.engine, "weights_version", 0))]

    def _step_all(self, steps: dict, episodes, envs, pool) -> dict:
        """The environment's answer to each episode of `steps` (a Step, or the kind of its failure), each waited
        for up to `step_timeout_s`; under tensor parallel stepped on the group's first process only, whose answers
        (with the counters the environment keeps on the episode) every process of the group then holds."""
        first = tensor_parallel_first(self.engine.model)
        if first:
            started = {e: (pool.submit(envs[e].step, episodes[e]), time.monotonic()) for e in steps}
            for e, (f, t0) in started.items():
                futures.wait([f], timeout=max(0.0, self.settings.step_timeout_s - (time.monotonic() - t0)))
                steps[e] = (_outcome(f), episodes[e].environment_counters())
        if self._tp:
            steps = from_tensor_parallel_first(steps, self.engine.model)
            for e, (_, counters) in steps.items():
                episodes[e].set_environment_counters(counters)
        return {e: outcome for e, (outcome, _) in steps.items()}

    # ------------------------------------------------------------------ turns

    def _version(self, model) -> int:
        """Before a forward of the decoding weights: partial rollouts (the engine's `between_steps` hook) may swap
        newer weights in; the version that forward samples with (0 without the hook)."""
        hook = getattr(self.engine, "between_steps", None)
        return int(hook(model)) if hook is not None else 0

    def _end_turn(self, ep: Episode, tokens: list[int], logprobs: list[float] | None,
                  versions: list[int] | None = None) -> bool:
        """The policy's turn `tokens` joins the episode; True when its environment is to answer it (not after
        `max_assistant_turns` assistant turns, nor after `max_user_turns` environment rounds: verl's checks)."""
        ep.add_policy(tokens, logprobs, versions)
        ep.assistant_turns += 1
        ended = bool(tokens) and tokens[-1] in self.engine.eos_ids
        harmony = self.settings.format == "gpt-oss"  # its calls are written in special tokens: keep them
        text = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=not harmony)
        ep.messages.append({"role": "assistant", "content": text})
        if not ended:  # the response budget ran out mid-turn
            ep.truncated = True
            return self._finish(ep)
        s = self.settings
        if (s.max_assistant_turns is not None and ep.assistant_turns >= s.max_assistant_turns) or \
                (s.max_user_turns is not None and ep.user_turns >= s.max_user_turns):
            return self._finish(ep)
        return True

    def _answer(self, ep: Episode, outcome: Step | str) -> list[int] | None:
        """The environment's answer to `ep`'s last turn applied (a Step, or the kind of the failure that ended the
        episode): the tokens appended (the episode goes on), or None (it ended)."""
        if not isinstance(outcome, Step):
            ep.count_error(outcome)
            return self._finish(ep)
        step = outcome
        ep.env_reward += float(step.reward)
        ep.add_metrics(step.metrics)
        if step.done or not step.messages:
            return self._finish(ep, log_only=step.messages)
        try:
            appended = self.template.appended(step.messages)
            if self._vision.intersection(appended):
                raise TemplateError("an environment's messages rendered with vision tokens: appended messages are "
                                    "text only (their images would have no image inputs)")
        except TemplateError as e:  # messages this chat template cannot render end their own episode, counted
            _warn_once(str(e))
            ep.count_error("template_error")
            return self._finish(ep, log_only=step.messages)
        if len(ep.tokens) + len(appended) >= self._budget:
            ep.truncated = True
            return self._finish(ep, log_only=step.messages)
        ep.user_turns += 1  # one environment round (verl's user turn), whatever roles its messages have
        ep.add_appended(appended)
        ep.messages.extend(dict(m) for m in step.messages)
        return appended

    def _finish(self, ep: Episode, log_only: list[dict] = ()):
        """End `ep`: the tokenization check on the conversation it holds; messages that came with the end are kept
        for the log only (they have no tokens)."""
        mode = self.settings.tokenization_sanity_check_mode
        # gpt-oss: nothing to compare with (its appended tokens are written by hand: the template cannot render them)
        if mode != "disable" and not ep.truncated and self.settings.format != "gpt-oss":
            ep.tokenization_mismatch = not self._same_as_rendered(ep, strict=mode == "strict")
        ep.messages.extend(dict(m) for m in log_only)
        ep.done = True

    def _same_as_rendered(self, ep: Episode, *, strict: bool) -> bool:
        kept = ep.prompt_ids + ep.tokens
        try:
            full = full_render(self.tokenizer, ep.messages, ep.tools, self.settings.template_kwargs,
                               images=ep.images, config=self.engine.model.config)
        except Exception:  # a template that cannot re-render the conversation counts as a mismatch
            return False
        if strict:
            return full[:len(kept)] == kept and full[len(kept):] in ([], self.template.glue)
        squash = lambda ids: "".join(self.tokenizer.decode(ids, skip_special_tokens=False).split())  # noqa: E731
        return squash(full) == squash(kept + self.template.glue) or squash(full) == squash(kept)


class StepThreads:
    """Environment steps, each in a daemon thread of its own, at most `workers` running at once. A step past its
    time limit is abandoned: its thread finishes or hangs on its own and never blocks the process's exit (a
    `ThreadPoolExecutor` joins its threads at exit, so a hung step would keep the process alive). After `close`,
    steps still waiting for a slot do not run."""

    def __init__(self, workers: int):
        self.slots, self.closed = threading.BoundedSemaphore(workers), False

    def submit(self, fn, *args) -> futures.Future:
        f: futures.Future = futures.Future()

        def run() -> None:
            with self.slots:
                if self.closed or not f.set_running_or_notify_cancel():
                    return
                try:
                    f.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the caller reads it from the future
                    f.set_exception(e)

        threading.Thread(target=run, daemon=True, name="environment-step").start()
        return f

    def close(self) -> None:
        self.closed = True


def _outcome(f: futures.Future) -> Step | str:
    """A finished step's Step, or the kind of failure: not finished in time, raised, or returned no Step."""
    if not f.done():
        return "environment_timeout"
    try:
        step = f.result()
    except Exception:  # an environment's fault ends its own episode, counted
        return "environment_raised"
    return step if isinstance(step, Step) else "environment_raised"


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s; the episode ends there (counted in agent/tool_errors/template_error)", message)


def _close(env) -> None:
    try:
        close = getattr(env, "close", None)
        if close is not None:
            close()
    except Exception:  # a failing close must not lose the step's episodes
        pass


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask
