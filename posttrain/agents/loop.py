"""The episode loop: every live episode decodes in one batch; one that ends its turn leaves the batch while its
environment answers (tools run in worker threads), and comes back with its keys and values kept — only the appended
tokens are computed. A slow tool delays only its own episode.

Token-in / token-out: the policy's sampled tokens are kept as sampled; appended messages are tokenized alone (the
template's delta, template.py). An episode ends on a turn its environment answers with `done` (the tool agent: a turn
without a tool call), at `max_assistant_turns` / `max_user_turns`, when its environment fails (counted), or at the
response budget (`data.max_response_length`: every token after the prompt, policy and appended alike; `truncated`).

`run_episodes` turns a batch of prompts into the multi-turn batch the trainer consumes (docs/agents.md: `responses`
holds every token after the prompt, `response_mask` is 1 on policy tokens only, `response_attention_mask` 1 on every
real token).
"""

from __future__ import annotations

import concurrent.futures as futures
import time
from typing import Callable

import torch

from ..models.load import attention_backends, autocast, eval_mode
from ..parallel import tensor_parallel
from ..rollout.base import SamplingParams
from ..rollout.sampling import next_tokens, sampled_logprobs
from ..rollout.weights import inference_weights
from .environment import ENVIRONMENTS, Environment, Step
from .episode import Episode
from .settings import AgentSettings
from .template import Template, encode_start, full_render

POLL_S = 0.005  # how long the loop waits for an environment when no episode is decoding


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
        self.template = Template(tokenizer, engine.eos_ids)

    # ------------------------------------------------------------------ the run

    def run(self, rows: list[dict], n: int, sampling: SamplingParams, *, continuous: bool = True) -> list[Episode]:
        """`n` episodes per row (consecutive), each decoding up to `sampling.max_new_tokens` tokens after its
        prompt. `continuous=False` runs the plain loop instead: each turn re-prefills every conversation and waits
        for the slowest episode (what the benchmark compares with; also the path of engines that cannot park, and
        of a tensor-parallel model, whose processes must decode the same rows in the same order)."""
        episodes, envs = [], []
        for row in rows:
            for _ in range(n):
                env = self.environments(row)
                start = env.reset(row)
                envs.append(env)
                episodes.append(Episode(prompt_ids=encode_start(self.tokenizer, start.messages, start.tools),
                                        messages=[dict(m) for m in start.messages], row=row, tools=start.tools))
        engine, self._budget = self.engine, sampling.max_new_tokens
        pool = futures.ThreadPoolExecutor(max_workers=max(1, self.settings.num_workers),
                                          thread_name_prefix="environment")
        try:
            with inference_weights(engine.model, engine.dtype) as model, \
                    attention_backends(torch.device(engine.device)):
                engine.prepare(model)
                # a tensor-parallel group decodes in lockstep (its forwards are collectives), but the continuous
                # loop's batch changes as environments happen to answer, which differs between the group's processes
                parks = (continuous and getattr(engine, "shared_prefix_ok", False) and hasattr(engine, "park")
                         and not tensor_parallel(model))
                with eval_mode(model), torch.no_grad(), autocast(engine.device, engine.dtype):
                    generator = (None if sampling.greedy else
                                 torch.Generator(engine.device).manual_seed(int(torch.randint(0, 2**62, (1,)))))
                    if parks:
                        self._continuous(model, episodes, envs, n, sampling, generator, pool)
                    else:
                        self._turn_by_turn(model, episodes, envs, sampling, generator, pool)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            for env in envs:
                _close(env)
        return episodes

    def _continuous(self, model, episodes, envs, n, sampling, generator, pool) -> None:
        engine, budget = self.engine, sampling.max_new_tokens
        shared = all(episodes[i].prompt_ids == episodes[i - i % n].prompt_ids for i in range(len(episodes)))
        firsts = episodes[::n] if shared else episodes
        ids, mask = _left_padded([e.prompt_ids for e in firsts], engine.pad_id)
        version = self._version(model)
        logits, state = engine.start(model, ids, mask, n if shared else 1, budget, share_prefix=False)
        made = [version] * len(state.ids)  # the weight version whose forward gave each row of `logits`
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
                        versions.append(made[j])
                        full = len(episodes[e].tokens) + len(tokens) >= budget
                        (ended if t in engine.eos_ids or full else kept).append(j)
                    if ended:
                        for j in ended:
                            e = int(state.ids[j])
                            if self._end_turn(episodes[e], *turn.pop(e)):
                                waiting[pool.submit(envs[e].step, episodes[e])] = (e, state.past(j), time.monotonic())
                            turn[e] = ([], [], [])
                        keep = torch.tensor(kept, dtype=torch.long, device=state.ids.device)
                        state.keep(keep)
                        logits, token, made = logits[keep], token[keep], [made[j] for j in kept]
                    if len(state.ids):
                        version = self._version(model)
                        logits = engine.step(model, state, token)
                        made = [version] * len(state.ids)
                if waiting:
                    idle = not len(state.ids)
                    done, _ = futures.wait(list(waiting), timeout=POLL_S if idle else 0,
                                           return_when=futures.FIRST_COMPLETED)
                    now = time.monotonic()
                    late = [f for f in waiting if f not in done and now - waiting[f][2] > self.settings.step_timeout_s]
                    back = []
                    for f in list(done) + late:
                        e, past, _ = waiting.pop(f)
                        appended = self._answer(episodes[e], f)
                        if appended is not None:
                            last = episodes[e].tokens[-len(appended) - 1]  # the turn's end token, not in `past`
                            back.append((e, past, torch.tensor([last] + appended)))
                    if back:  # the episodes whose environments answered rejoin together: one forward
                        version = self._version(model)
                        more = engine.resume_many(model, state, back,
                                                  max(budget - len(episodes[e].tokens) for e, _, _ in back))
                        logits = torch.cat([logits, more.to(logits.dtype)])
                        made += [version] * len(back)
        for ep in episodes:
            ep.done = True

    def _turn_by_turn(self, model, episodes, envs, sampling, generator, pool) -> None:
        """Each turn: every live conversation re-prefilled and decoded together; then every environment step; the
        next turn starts when the slowest one has answered."""
        engine, budget = self.engine, sampling.max_new_tokens
        live = list(range(len(episodes)))
        while live:
            room = max(budget - len(episodes[e].tokens) for e in live)
            ids, mask = _left_padded([episodes[e].prompt_ids + episodes[e].tokens for e in live], engine.pad_id)
            s = SamplingParams(n=1, do_sample=sampling.do_sample, temperature=sampling.temperature,
                               top_p=sampling.top_p, top_k=sampling.top_k, max_new_tokens=room,
                               logprobs=sampling.logprobs)
            tokens, logprobs, step_versions = engine.decode(model, ids, mask, s)
            steps = {}
            for j, e in enumerate(live):
                own = tokens[j, : budget - len(episodes[e].tokens)].tolist()
                stop = next((i for i, t in enumerate(own) if t in engine.eos_ids), None)
                own = own if stop is None else own[: stop + 1]
                lps = logprobs[j, : len(own)].tolist() if logprobs is not None else None
                versions = (step_versions + step_versions[-1:] * len(own))[:len(own)] if step_versions else None
                if self._end_turn(episodes[e], own, lps, versions):
                    steps[e] = (pool.submit(envs[e].step, episodes[e]), time.monotonic())
            live = []
            for e, (f, started) in steps.items():
                futures.wait([f], timeout=max(0.0, self.settings.step_timeout_s - (time.monotonic() - started)))
                if self._answer(episodes[e], f) is not None:
                    live.append(e)
        for ep in episodes:
            ep.done = True

    # ------------------------------------------------------------------ turns

    def _version(self, model) -> int:
        """Before a forward of the decoding weights: partial rollouts (the engine's `between_steps` hook) may swap
        newer weights in; the version that forward samples with (0 without the hook)."""
        hook = getattr(self.engine, "between_steps", None)
        return int(hook(model)) if hook is not None else 0

    def _end_turn(self, ep: Episode, tokens: list[int], logprobs: list[float] | None,
                  versions: list[int] | None = None) -> bool:
        """The policy's turn `tokens` joins the episode; True when its environment is to answer it."""
        ep.add_policy(tokens, logprobs, versions)
        ep.assistant_turns += 1
        ended = bool(tokens) and tokens[-1] in self.engine.eos_ids
        text = self.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True)
        ep.messages.append({"role": "assistant", "content": text})
        if not ended:  # the response budget ran out mid-turn
            ep.truncated = True
            return self._finish(ep)
        limit = self.settings.max_assistant_turns
        if limit is not None and ep.assistant_turns >= limit:
            return self._finish(ep)
        return True

    def _answer(self, ep: Episode, f: futures.Future) -> list[int] | None:
        """The environment's answer to `ep`'s last turn applied: the tokens appended (the episode goes on), or None
        (it ended)."""
        if not f.done():
            ep.count_error("environment_timeout")
            return self._finish(ep)
        try:
            step = f.result()
            if not isinstance(step, Step):
                raise TypeError(f"step() returned {type(step).__name__}, not Step")
        except Exception:  # an environment's fault ends its own episode, counted
            ep.count_error("environment_raised")
            return self._finish(ep)
        ep.env_reward += float(step.reward)
        ep.add_metrics(step.metrics)
        users = sum(m.get("role") == "user" for m in step.messages)
        limit = self.settings.max_user_turns
        if step.done or not step.messages or (limit is not None and ep.user_turns + users > limit):
            return self._finish(ep, log_only=step.messages)
        appended = self.template.appended(step.messages)
        if len(ep.tokens) + len(appended) >= self._budget:
            ep.truncated = True
            return self._finish(ep, log_only=step.messages)
        ep.user_turns += users
        ep.add_appended(appended)
        ep.messages.extend(dict(m) for m in step.messages)
        return appended

    def _finish(self, ep: Episode, log_only: list[dict] = ()):
        """End `ep`: the tokenization check on the conversation it holds; messages that came with the end are kept
        for the log only (they have no tokens)."""
        mode = self.settings.tokenization_sanity_check_mode
        if mode != "disable" and not ep.truncated:
            ep.tokenization_mismatch = not self._same_as_rendered(ep, strict=mode == "strict")
        ep.messages.extend(dict(m) for m in log_only)
        ep.done = True

    def _same_as_rendered(self, ep: Episode, *, strict: bool) -> bool:
        kept = ep.prompt_ids + ep.tokens
        try:
            full = full_render(self.tokenizer, ep.messages, ep.tools)
        except Exception:  # a template that cannot re-render the conversation counts as a mismatch
            return False
        if strict:
            return full[:len(kept)] == kept and full[len(kept):] in ([], self.template.glue)
        squash = lambda ids: "".join(self.tokenizer.decode(ids, skip_special_tokens=False).split())  # noqa: E731
        return squash(full) == squash(kept + self.template.glue) or squash(full) == squash(kept)


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
