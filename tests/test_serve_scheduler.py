"""The serving scheduler against its definition: each sample's tokens are what the model gives for its own prompt
alone (greedy: the argmax of a float64 full forward over prompt + tokens so far, no cache), whatever joins, leaves or
fails around it; log-probs are the float64 forward's at the sampled tokens; a seed fixes a request's tokens;
stop ids, max_tokens, cancel, the queue bound and the context bound end or refuse requests as documented. The model
is the tiny one with random weights."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest
import torch

import posttrain.rollout.decode_state as decode_state
import posttrain.rollout.engine as engine_module
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.kv_blocks import BLOCK
from posttrain.serve.prefix_cache import MIN_REUSED_TOKENS, PrefixCache
from posttrain.serve.scheduler import SLOT_ROWS, PromptTooLong, QueueFull, RequestSampling, Scheduler

GREEDY = RequestSampling(temperature=0.0, max_tokens=8)
PROMPTS = [[5, 17, 33, 2, 9, 41], [71, 8, 12], [3, 99, 250, 4, 18, 7, 61, 120, 45], [200, 11]]


@pytest.fixture(scope="module")
def lm64(lm):
    return copy.deepcopy(lm).double()


@pytest.fixture
def engine(lm, tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(decode_state, "FIRST_CAPACITY", 4)  # suffix buffers grow mid-run
    return DecodeEngine(lm, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture
def scheduler(engine):
    made = []

    def make(**kw):
        made.append(Scheduler(engine, **kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


def greedy(lm64, prompt, steps, stops):
    """The greedy continuation by full forwards: (tokens, finish)."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(lm64(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in stops:
                return out, "stop"
    return out, "length"


def collect(handle, timeout=30.0):
    """{sample: (tokens, logprobs, finish)} from the handle's events, checking each sample ends exactly once, last."""
    samples = {}
    for event in handle.events(timeout=timeout):
        tokens, logprobs, finish = samples.setdefault(event.sample, ([], [], []))
        assert not finish, "an event after the sample's final one"
        if event.token is None:
            finish.append(event.finish)
        else:
            tokens.append(event.token)
            logprobs.append(event.logprob)
    assert sorted(samples) == list(range(handle.n))
    return {s: (t, lp, f[0]) for s, (t, lp, f) in samples.items()}


def on_step(engine, monkeypatch, actions):
    """Run `actions[k]()` in the scheduler's thread just before its k-th decoding step (1-based)."""
    count = [0]
    step = engine.step

    def counted(model, state, token):
        count[0] += 1
        if count[0] in actions:
            actions[count[0]]()
        return step(model, state, token)
    monkeypatch.setattr(engine, "step", counted)
    return count


def test_greedy_requests_give_the_full_forward_greedy_continuation(engine, scheduler, lm64):
    """Requests prefilled together (different prompt lengths) each decode their prompt's greedy continuation."""
    sched = scheduler()
    handles = [sched.submit(p, 1, GREEDY) for p in PROMPTS]
    sched.start()
    for prompt, handle in zip(PROMPTS, handles):
        tokens, _, finish = collect(handle)[0]
        assert (tokens, finish) == greedy(lm64, prompt, 8, engine.eos_ids)


def test_single_sample_requests_open_one_row_slots_that_a_larger_request_joins(engine, scheduler, lm64, monkeypatch):
    """Requests of one sample each open a decoding state of one row per slot (no slot rows decode on zeros); a request
    of several samples of one prompt that joins it mid-run takes one slot per sample, and every sample still gets its
    prompt's greedy continuation."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    groups, joined = [], {}
    start = engine.start_slots

    def spied(*args, **kw):
        logits, state = start(*args, **kw)
        groups.append(state.group)
        return logits, state
    monkeypatch.setattr(engine, "start_slots", spied)
    on_step(engine, monkeypatch, {2: lambda: joined.setdefault(0, sched.submit(PROMPTS[2], 3, GREEDY))})
    first = [sched.submit(p, 1, RequestSampling(temperature=0.0, max_tokens=10)) for p in PROMPTS[:2]]
    sched.start()
    for prompt, handle in zip(PROMPTS, first):
        assert collect(handle)[0][::2] == greedy(lm64, prompt, 10, set())
    assert groups == [1]
    assert [(t, f) for t, _, f in collect(joined[0]).values()] == [greedy(lm64, PROMPTS[2], 8, set())] * 3


def test_requests_joining_and_leaving_mid_run_decode_as_alone(engine, scheduler, lm64, monkeypatch):
    """Requests that join while others decode, of different n (more samples than a slot holds) and max_tokens (rows
    leave at different steps), two with the same prompt joining together (sharing its slot), give every sample the
    greedy continuation of its own prompt."""
    engine.eos_ids = {10**6}  # every request runs to max_tokens: the steps that submit come
    sched = scheduler()
    assert SLOT_ROWS < 6
    plan = [(PROMPTS[0], 2, 12), (PROMPTS[1], 1, 3), (PROMPTS[2], 6, 9), (PROMPTS[3], 1, 6), (PROMPTS[3], 2, 7)]
    handles = {}

    def submit(i):
        prompt, n, max_tokens = plan[i]
        handles[i] = sched.submit(prompt, n, RequestSampling(temperature=0.0, max_tokens=max_tokens))
    on_step(engine, monkeypatch, {2: lambda: submit(2), 4: lambda: (submit(3), submit(4))})
    submit(0)
    submit(1)
    sched.start()
    results = {i: collect(handles[i]) for i in (0, 1)}  # request 0 outlives step 4
    results.update({i: collect(handles[i]) for i in (2, 3, 4)})
    for i, (prompt, n, max_tokens) in enumerate(plan):
        want = greedy(lm64, prompt, max_tokens, engine.eos_ids)
        assert [(t, f) for t, _, f in results[i].values()] == [want] * n, i


def test_sampled_logprobs_are_the_float64_forwards(engine, scheduler, lm64, monkeypatch):
    """Each sampled token's log-prob equals log_softmax(logits / temperature) of a float64 full forward at it, for
    every sample: of a request decoding from the start, and of requests joining mid-run, one with more samples than a
    slot holds and one with the same prompt (sharing a slot with it) at another temperature and with a seed."""
    engine.eos_ids = {10**6}  # the second step comes
    sched = scheduler()
    plan = [(PROMPTS[0], 3, 0.8, None), (PROMPTS[2], SLOT_ROWS + 1, 1.0, None), (PROMPTS[2], 2, 0.7, 5)]
    handles = []

    def submit(prompt, n, temperature, seed):
        handles.append(sched.submit(prompt, n, RequestSampling(temperature=temperature, max_tokens=6, seed=seed)))
    on_step(engine, monkeypatch, {2: lambda: (submit(*plan[1]), submit(*plan[2]))})
    submit(*plan[0])
    sched.start()
    results = [collect(handles[0])] + [collect(h) for h in handles[1:]]
    for (prompt, _, temperature, _), result in zip(plan, results):
        for tokens, logprobs, _ in result.values():
            with torch.no_grad():
                logits = lm64(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            want = torch.log_softmax(logits / temperature, dim=-1)[torch.arange(len(tokens)), tokens]
            torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)


def test_a_seed_gives_the_same_tokens_whatever_else_runs(engine, scheduler, monkeypatch):
    """A seeded request alone, then again among unseeded and other seeded requests joining at other steps: the
    same tokens per sample."""
    engine.eos_ids = {10**6}
    seeded = RequestSampling(temperature=1.0, max_tokens=10, seed=1234)
    alone = scheduler()
    first = alone.submit(PROMPTS[2], 2, seeded)
    alone.start()
    want = collect(first)
    alone.close()
    assert want[0][0] != want[1][0]  # the two samples are two draws

    busy = scheduler()
    others = []
    on_step(engine, monkeypatch, {1: lambda: others.append(busy.submit(PROMPTS[0], 1, seeded)),
                                  3: lambda: others.append(busy.submit(PROMPTS[3], 2, RequestSampling(max_tokens=5)))})
    others.append(busy.submit(PROMPTS[1], 3, RequestSampling(temperature=1.0, max_tokens=10)))
    again = busy.submit(PROMPTS[2], 2, RequestSampling(temperature=1.0, max_tokens=10, seed=1234))
    busy.start()
    assert {s: t for s, (t, _, _) in collect(again).items()} == {s: t for s, (t, _, _) in want.items()}
    for handle in others:
        collect(handle)


def test_stop_ids_eos_and_max_tokens_end_samples(engine, scheduler, lm64):
    """A stop id ends the sample on it ("stop", the stop id its last token), as the model's EOS does; max_tokens ends
    it with "length"."""
    engine.eos_ids = {10**6}  # no EOS in the reference run
    ref, _ = greedy(lm64, PROMPTS[0], 10, set())
    k = next(i for i in range(2, 10) if ref[i] not in ref[:i])
    sched = scheduler()
    by_stop = sched.submit(PROMPTS[0], 1, RequestSampling(temperature=0.0, max_tokens=10, stop_token_ids=(ref[k],)))
    by_length = sched.submit(PROMPTS[0], 1, RequestSampling(temperature=0.0, max_tokens=3))
    engine.eos_ids = {ref[k]}
    by_eos = sched.submit(PROMPTS[0], 1, RequestSampling(temperature=0.0, max_tokens=10))
    sched.start()
    assert collect(by_stop)[0][::2] == (ref[:k + 1], "stop")
    assert collect(by_length)[0][::2] == (ref[:3], "length")
    assert collect(by_eos)[0][::2] == (ref[:k + 1], "stop")


def test_cancelling_one_sample_ends_it_only(engine, scheduler, lm64, monkeypatch):
    """Sample 1 of three, cancelled mid-run, ends "cancelled" after a prefix of its tokens; its siblings run to
    max_tokens; a waiting request cancelled as a whole ends every sample "cancelled"."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    handle = sched.submit(PROMPTS[2], 3, RequestSampling(temperature=0.0, max_tokens=12))
    on_step(engine, monkeypatch, {3: lambda: handle.cancel(1)})
    queued = sched.submit(PROMPTS[0], 2, GREEDY)
    queued.cancel()
    sched.start()
    ref, _ = greedy(lm64, PROMPTS[2], 12, set())
    got = collect(handle)
    assert got[0][::2] == got[2][::2] == (ref, "length")
    tokens, _, finish = got[1]
    assert finish == "cancelled" and 3 <= len(tokens) < 12 and tokens == ref[:len(tokens)]
    assert {s: f for s, (_, _, f) in collect(queued).items()} == {0: "cancelled", 1: "cancelled"}


def test_the_queue_bound_the_context_bound_and_bad_input_refuse_requests(scheduler, lm):
    sched = scheduler(max_waiting=2)
    context = lm.config.max_position_embeddings
    assert sched.context_length == context
    with pytest.raises(PromptTooLong):
        sched.submit([5] * (context - 2), 1, RequestSampling(max_tokens=3))
    held = [sched.submit([5] * (context - 2), 1, RequestSampling(max_tokens=2)), sched.submit([5], 1, GREEDY)]
    with pytest.raises(QueueFull):
        sched.submit([5], 1, GREEDY)
    bad = [([5], sched.max_running + 1, GREEDY), ([], 1, GREEDY), ([lm.config.vocab_size], 1, GREEDY),
           ([5], 1, RequestSampling(max_tokens=0)), ([5], 1, RequestSampling(temperature=-1.0)),
           ([5], 1, RequestSampling(top_p=0.0))]
    for prompt, n, sampling in bad:
        with pytest.raises(ValueError):
            sched.submit(prompt, n, sampling)
    sched.close()
    assert [collect(h)[0][2] for h in held] == ["cancelled", "cancelled"]


def test_a_failing_prefill_ends_its_own_request_only(engine, scheduler, lm64, monkeypatch):
    """A prompt whose prefill raises, among prompts prefilled together and as a request joining mid-run, ends its
    request with "error"; the others decode their greedy continuations."""
    poison = 222
    prefill = engine_module.prefill

    def failing(forward, config, prompts, mask, *args):
        if (prompts == poison).any():
            raise RuntimeError("injected")
        return prefill(forward, config, prompts, mask, *args)
    monkeypatch.setattr(engine_module, "prefill", failing)
    engine.eos_ids = {10**6}  # every request runs to max_tokens: the second step comes
    sched = scheduler()
    late, submitted = [], threading.Event()
    on_step(engine, monkeypatch, {2: lambda: (late.extend([sched.submit([poison, 3], 2, GREEDY),
                                                           sched.submit(PROMPTS[3], 1, GREEDY)]), submitted.set())})
    good = [sched.submit(PROMPTS[0], 1, GREEDY), sched.submit(PROMPTS[1], 2, GREEDY)]
    bad = sched.submit([7, poison, 9], 1, GREEDY)
    sched.start()
    assert collect(bad)[0] == ([], [], "error")
    assert submitted.wait(10)
    assert collect(late[0]) == {0: ([], [], "error"), 1: ([], [], "error")}
    for prompt, handle in zip((PROMPTS[0], PROMPTS[1], PROMPTS[3]), good + late[1:]):
        for tokens, _, finish in collect(handle).values():
            assert (tokens, finish) == greedy(lm64, prompt, 8, engine.eos_ids)


def test_a_failing_step_ends_the_batch_and_serving_goes_on(engine, scheduler, lm64, monkeypatch):
    engine.eos_ids = {10**6}
    sched = scheduler()

    def fail():
        raise RuntimeError("injected")
    on_step(engine, monkeypatch, {3: fail})
    first = sched.submit(PROMPTS[0], 2, RequestSampling(temperature=0.0, max_tokens=20))
    sched.start()
    assert {s: f for s, (_, _, f) in collect(first).items()} == {0: "error", 1: "error"}
    after = sched.submit(PROMPTS[1], 1, GREEDY)
    assert collect(after)[0][::2] == greedy(lm64, PROMPTS[1], 8, engine.eos_ids)


def test_no_step_runs_while_paused(engine, scheduler, lm64, monkeypatch):
    """Inside `paused()` no decoding step runs and a request submitted then waits; afterwards both requests decode
    their greedy continuations."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    gate, resume = threading.Event(), threading.Event()
    count = on_step(engine, monkeypatch, {2: lambda: (gate.set(), resume.wait(10))})
    running = sched.submit(PROMPTS[0], 1, RequestSampling(temperature=0.0, max_tokens=12))
    sched.start()
    assert gate.wait(10)
    entered = threading.Event()

    def pause():
        with sched.paused():
            entered.set()
            steps = count[0]
            queued.append(sched.submit(PROMPTS[1], 1, GREEDY))
            time.sleep(0.1)
            assert count[0] == steps
    queued = []
    pauser = threading.Thread(target=pause)
    pauser.start()
    time.sleep(0.05)
    assert not entered.is_set()  # a step is running: the pause waits for it
    resume.set()
    pauser.join(10)
    assert entered.is_set()
    assert collect(running)[0][::2] == greedy(lm64, PROMPTS[0], 12, set())
    assert collect(queued[0])[0][::2] == greedy(lm64, PROMPTS[1], 8, set())


def test_events_reach_an_asyncio_consumer(engine, scheduler, lm64):
    sched = scheduler()
    handle = sched.submit(PROMPTS[1], 2, GREEDY)
    sched.start()

    async def read():
        return [e async for e in handle.aevents()]
    events = asyncio.run(read())
    want_tokens, want_finish = greedy(lm64, PROMPTS[1], 8, engine.eos_ids)
    for sample in (0, 1):
        mine = [e for e in events if e.sample == sample]
        assert [e.token for e in mine] == want_tokens + [None] and mine[-1].finish == want_finish


@pytest.mark.parametrize("consumer", ["thread", "asyncio"])
def test_a_wake_with_nothing_to_read_keeps_the_consumer_waiting(consumer):
    """A consumer woken with no event to read (a put of no events, as cancelling an ended sample makes) waits for the
    next event instead of failing on an empty queue (a server answered such a request with a 500)."""
    from posttrain.serve.scheduler import Event, Handle

    handle, got, final = Handle(None, 1), [], Event(0, None, None, "stop")

    async def read():
        return [e async for e in handle.aevents()]

    def consume():
        got.extend(handle.events(timeout=5) if consumer == "thread" else asyncio.run(read()))

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    deadline = time.monotonic() + 5
    while handle._wake is None and time.monotonic() < deadline:  # the consumer waits
        time.sleep(0.005)
    handle._put([])
    time.sleep(0.05)
    handle._put([final])
    reader.join(5)
    assert got == [final]
def test_an_event_loop_is_woken_once_per_step_for_all_its_consumers(engine, scheduler):
    """Many requests read on one event loop: the scheduler wakes the loop at most once per decoding step, not once per
    request per token."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    handles = [sched.submit(p, 1, GREEDY) for p in PROMPTS]
    loop = asyncio.new_event_loop()
    wakes = []
    threadsafe = loop.call_soon_threadsafe

    def counted(*args):
        wakes.append(args)
        return threadsafe(*args)
    loop.call_soon_threadsafe = counted

    async def read(handle):
        return [e async for e in handle.aevents()]

    async def read_all():
        sched.start()
        return await asyncio.gather(*(read(h) for h in handles))
    try:
        events = loop.run_until_complete(read_all())
    finally:
        loop.close()
    assert [len(e) for e in events] == [GREEDY.max_tokens + 1] * len(PROMPTS)
    assert 1 <= len(wakes) <= GREEDY.max_tokens  # one decoding step per token


def test_a_reader_of_final_events_only_is_woken_once_per_sample_end(engine, scheduler):
    """`notify(..., final=True)`: the callback runs when a sample's final event has come, with every event before
    it there to take, not once per token."""
    sched = scheduler()
    handle = sched.submit(PROMPTS[0], 1, GREEDY)
    woken = []
    assert handle.notify(None, lambda: woken.append(list(handle._events)), final=True)
    sched.start()
    deadline = time.monotonic() + 30
    while not woken and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(woken) == 1 and woken[0][-1].finish is not None
    events = handle.take()
    assert len(events) == GREEDY.max_tokens + 1 or events[-1].finish == "stop"
    assert events[-1].finish is not None and all(e.token is not None for e in events[:-1])


def test_a_model_the_shared_prefix_step_does_not_run_is_refused(engine):
    engine.shared_prefix_ok = False  # as the self-check decides for such a model
    with pytest.raises(ValueError, match="shared-prefix"):
        Scheduler(engine)


def test_a_consumer_leaving_early_cancels_its_request(engine, scheduler, monkeypatch):
    """A consumer that stops reading (a client gone) cancels the samples still running: they end "cancelled"."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    left = threading.Event()
    on_step(engine, monkeypatch, {2: lambda: left.wait(10)})
    handle = sched.submit(PROMPTS[1], 2, RequestSampling(temperature=0.0, max_tokens=40))
    sched.start()
    for _ in handle.events(timeout=10):
        break
    left.set()
    rest = list(handle.events(timeout=10))
    assert sorted(e.finish for e in rest if e.finish) == ["cancelled", "cancelled"]
    assert len(rest) < 2 * 40


def test_no_event_within_the_timeout_raises_and_cancels(scheduler):
    sched = scheduler()  # not started: nothing decodes
    handle = sched.submit(PROMPTS[0], 1, GREEDY)
    with pytest.raises(TimeoutError):
        next(handle.events(timeout=0.05))
    assert [(e.token, e.finish) for e in handle.events(timeout=1)] == [(None, "cancelled")]


# ------------------------------------------------------------------ the prefix cache

def conversation(seed, length=20):
    """A prompt longer than the prefix cache's shortest reuse."""
    assert length > MIN_REUSED_TOKENS
    return torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_full_forward(lm64, prompt, result, temperature=None):
    """Greedy (temperature None): each sample's tokens are the full-forward greedy continuation; every sample's
    log-probs are the float64 full forward's at its tokens."""
    for tokens, logprobs, finish in result.values():
        if temperature is None:
            assert (tokens, finish) == greedy(lm64, prompt, len(tokens), set())
        with torch.no_grad():
            logits = lm64(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits / (temperature or 1.0), dim=-1)[torch.arange(len(tokens)), tokens]
        torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)


@pytest.fixture
def resumed(engine, monkeypatch):
    """The prompts that joined by resuming kept keys and values (per join: the tokens computed for each)."""
    joins = []
    for name in ("add", "start_slots"):
        original = getattr(engine, name)

        def spied(*args, _original=original, **kw):
            if kw.get("pasts") is not None:
                prompts = args[2] if _original.__name__ == "add" else args[1]
                joins.append([t.tolist() for t in prompts])
            return _original(*args, **kw)
        monkeypatch.setattr(engine, name, spied)
    return joins


def run_turn(sched, prompt, n=1, sampling=RequestSampling(temperature=0.0, max_tokens=8)):
    handle = sched.submit(prompt, n, sampling)
    sched.start()
    return collect(handle)


def test_a_turn_extending_a_finished_sample_computes_only_its_new_tokens(engine, scheduler, lm64, resumed):
    """A second turn whose prompt is the first turn's prompt + completion + new tokens resumes from the kept keys
    and values (only the last sampled token and the new tokens are computed) and decodes what a full prefill gives:
    greedy tokens, and, for 3 sampled samples sharing the resumed prefix, the float64 forward's log-probs."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    first = conversation(0)
    completion = run_turn(sched, first)[0][0]
    assert sched.stats["prefix_cache_tokens"] == len(first) + 7  # the last sampled token was never decoded
    second = first + completion + [40, 41, 42]
    assert_full_forward(lm64, second, run_turn(sched, second))
    assert resumed == [[completion[-1:] + [40, 41, 42]]]
    third = second + run_turn(sched, second)[0][0] + [50, 51]  # `second` again: a prefix of what is kept
    assert_full_forward(lm64, third, run_turn(sched, third, 3, RequestSampling(temperature=0.9, max_tokens=6)),
                        temperature=0.9)
    stats = sched.stats
    assert stats["prefix_cache_hits"] == 3 and stats["requests"] == 4
    assert stats["prefix_cache_tokens_reused"] == (len(first) + 7) + (len(second) - 1) + (len(second) + 7)
    assert stats["prefix_cache_sequences"] == 3  # the third turn's three samples; the turns before are prefixes


def test_a_prompt_sharing_part_of_a_kept_sequence_reuses_the_shared_part(engine, scheduler, lm64, resumed):
    """A prompt that leaves a kept sequence mid-way reuses its common prefix only; a prompt that is a prefix of a
    kept sequence reuses all of it but its last token; a prompt sharing too few tokens is prefilled whole."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    first = conversation(1)
    completion = run_turn(sched, first)[0][0]
    branch = first[:18] + [7, 7, 7] + completion
    assert_full_forward(lm64, branch, run_turn(sched, branch))
    shorter = first + completion[:3]
    assert_full_forward(lm64, shorter, run_turn(sched, shorter))
    unrelated = first[:MIN_REUSED_TOKENS - 1] + conversation(2)
    assert_full_forward(lm64, unrelated, run_turn(sched, unrelated))
    assert resumed == [[branch[18:]], [shorter[-1:]]]
    assert sched.stats["prefix_cache_tokens_reused"] == 18 + len(shorter) - 1


def test_resumed_and_new_prompts_join_a_running_batch_together(engine, scheduler, lm64, monkeypatch, resumed):
    """Two conversations' next turns and two new prompts submitted at once, while another request decodes: the two
    resumed ones are computed in one forward beside the new ones' prefill, and every request decodes what a full
    prefill gives."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    firsts = [conversation(3), conversation(4, 25)]
    done = [run_turn(sched, p)[0][0] for p in firsts]
    seconds = [p + c + [60 + i] for i, (p, c) in enumerate(zip(firsts, done))]
    news = [conversation(5), PROMPTS[2]]
    later = []
    on_step(engine, monkeypatch, {3: lambda: later.extend(sched.submit(p, 2, GREEDY) for p in seconds + news)})
    long = sched.submit(PROMPTS[0], 1, RequestSampling(temperature=0.0, max_tokens=14))
    assert collect(long)[0][::2] == greedy(lm64, PROMPTS[0], 14, set())
    for prompt, handle in zip(seconds + news, later):
        assert_full_forward(lm64, prompt, collect(handle))
    assert resumed == [[done[0][-1:] + [60], done[1][-1:] + [61]]]
    assert sched.stats["prefix_cache_hits"] == 2


def test_the_least_recently_used_sequences_leave_a_full_cache(engine, scheduler, lm64, resumed):
    """Under a budget of 60 tokens, keeping a third 27-token sequence drops the least recently used one (the first:
    the second was used since); a turn continuing it is prefilled whole, and still decodes right."""
    engine.eos_ids = {10**6}
    sched = scheduler(prefix_cache_tokens=60)
    a, b, c = conversation(6), conversation(7), conversation(8)
    done = {0: run_turn(sched, a)[0][0], 1: run_turn(sched, b)[0][0]}
    assert sched.stats["prefix_cache_tokens"] == 54
    b2 = b + done[1][:2]  # a prefix of b's sequence: a hit, which makes b the most recently used
    run_turn(sched, b2)
    run_turn(sched, c)
    stats = sched.stats
    assert stats["prefix_cache_evicted"] == 1 and stats["prefix_cache_tokens"] <= 60
    a2 = a + done[0] + [9]
    assert_full_forward(lm64, a2, run_turn(sched, a2))
    assert len(resumed) == 1 and sched.stats["prefix_cache_hits"] == 1


def test_without_the_cache_every_prompt_is_prefilled_whole(engine, scheduler, lm64, resumed):
    engine.eos_ids = {10**6}
    sched = scheduler(prefix_cache_tokens=0)
    first = conversation(9)
    second = first + run_turn(sched, first)[0][0] + [5]
    assert_full_forward(lm64, second, run_turn(sched, second))
    assert resumed == [] and sched.stats["prefix_cache_hits"] == 0 and sched.stats["prefix_cache_tokens"] == 0


def test_weights_changed_inside_a_pause_are_not_read_from_kept_keys_and_values(engine, scheduler, lm, lm64, resumed):
    """A pause clears the cache: a turn after weights changed inside it decodes what the new weights give."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    first = conversation(10)
    second = first + run_turn(sched, first)[0][0] + [5]
    k_proj = next(p for name, p in lm.named_parameters() if "k_proj.weight" in name)
    saved = k_proj.detach().clone()
    try:
        with sched.paused():
            with torch.no_grad():
                k_proj.mul_(-1.5)
        changed = copy.deepcopy(lm).double()
        assert_full_forward(changed, second, run_turn(sched, second))
    finally:
        with torch.no_grad():
            k_proj.copy_(saved)
    assert resumed == [] and sched.stats["prefix_cache_hits"] == 0


def test_a_sample_decoding_across_a_pause_is_not_kept(engine, scheduler, lm, monkeypatch, resumed):
    """A sample that started before a pause in which the weights changed has keys of both weights: when it ends it
    is not kept (counted stale), and the next turn is prefilled on the new weights whole."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    gate, resume = threading.Event(), threading.Event()
    on_step(engine, monkeypatch, {3: lambda: (gate.set(), resume.wait(10))})
    first = conversation(11)
    running = sched.submit(first, 1, RequestSampling(temperature=0.0, max_tokens=10))
    sched.start()
    assert gate.wait(10)
    k_proj = next(p for name, p in lm.named_parameters() if "k_proj.weight" in name)
    saved = k_proj.detach().clone()

    changed = []

    def change_weights():
        with sched.paused(), torch.no_grad():
            k_proj.mul_(-1.5)
            changed.append(copy.deepcopy(lm).double())  # the model is not in decoding mode inside a pause
    pauser = threading.Thread(target=change_weights)
    try:
        pauser.start()
        while not sched._pauses:  # the pause is asked for while the step is under way
            time.sleep(0.01)
        resume.set()  # the step ends, the pause comes, the sample goes on on the new weights
        pauser.join(10)
        completion = collect(running)[0][0]
        stats = sched.stats
        assert stats["prefix_cache_sequences"] == 0 and stats["prefix_cache_stale"] == 1
        second = first + completion + [5]
        assert_full_forward(changed[0], second, run_turn(sched, second))
    finally:
        with torch.no_grad():
            k_proj.copy_(saved)
    assert resumed == [] and sched.stats["prefix_cache_hits"] == 0


def test_the_prefix_cache_finds_the_longest_kept_prefix_and_keeps_no_prefix_of_a_kept_sequence():
    """Of two kept sequences, a prompt reuses the one it shares more tokens with (to the token, past a block
    boundary), always leaving its last token to compute; keeping a sequence drops kept ones that are its prefixes,
    and a sequence that is a prefix of a kept one is not kept again."""
    def past(ids):  # position i's "key" is its token: a slice is checkable
        x = torch.tensor(ids, dtype=torch.float32)[None, None, :, None]
        return [x], [x]
    cache = PrefixCache(1000)
    base = list(range(3, 3 + 20))
    near, far = base + [100] * 15, base + [101] * 15
    cache.put(far, past(far))
    cache.put(near, past(near))
    (keys, _), m = cache.match(base + [100] * 9 + [7, 8])
    assert m == 29 and keys[0].flatten().tolist() == near[:29]
    assert cache.match(near)[1] == len(near) - 1
    assert cache.match(list(range(200, 240))) is None
    longer = near + [5] * 10
    cache.put(longer, past(longer))
    cache.put(near[:25], past(near[:25]))
    assert len(cache) == 2 and cache.tokens == len(far) + len(longer)


# ------------------------------------------------------------------ keys and values in blocks


def blocks_for(length):
    return -(-length // BLOCK)


def settled(sched):
    """Wait until the scheduler thread has let its decoding state go (it does so after the last final event)."""
    deadline = time.monotonic() + 30
    while sched._state is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return sched


def test_rows_hold_the_blocks_their_tokens_fill_and_nothing_for_max_tokens(engine, scheduler, monkeypatch):
    """A long request (max_tokens 40) decodes; a 3-token request joins at step 20 and leaves after 4 tokens: at every
    step the pool's used blocks are each row's ceil(positions written / 16) — no block reserved for a row's
    max_tokens, none held by the short row for the long one's columns — and all are free once both end."""
    engine.eos_ids = {10**6}
    sched = scheduler(prefix_cache_tokens=0)
    steps, joined = [], []

    def record(k):
        want = sum(blocks_for(len(row.request.prompt) + row.count - 1) for row in sched._rows)
        steps.append((sched.stats["kv_blocks_used"], want, len(sched._rows)))
        if k == 20:
            joined.append(sched.submit([7, 8, 9], 1, RequestSampling(temperature=0.0, max_tokens=4)))
    on_step(engine, monkeypatch, {k: lambda k=k: record(k) for k in range(1, 41)})
    long = sched.submit(PROMPTS[2], 1, RequestSampling(temperature=0.0, max_tokens=40))
    sched.start()
    collect(long)
    collect(joined[0])
    assert len(steps) == 39 and {rows for _, _, rows in steps} == {1, 2}
    assert all(used == want for used, want, _ in steps), steps
    assert settled(sched).stats["kv_blocks_used"] == 0 and sched.stats["kv_blocks_free"] > 0


def test_a_continuing_turn_references_the_kept_blocks_and_no_block_leaks(engine, scheduler, lm64, monkeypatch):
    """A 40-token conversation's first turn ends (its 47 positions kept: 3 blocks); its next turn (n=2) references
    the kept sequence's 2 whole blocks in its slot (reference counts: the cache's and the slot's) and decodes what a
    full prefill gives. After every request ends, each used block is held by
    the cache alone, as many times as kept sequences contain it; clearing the cache frees them all."""
    engine.eos_ids = {10**6}
    sched = scheduler()
    first = conversation(7, 40)
    completion = run_turn(sched, first)[0][0]
    assert settled(sched).stats["kv_blocks_used"] == blocks_for(len(first) + 7)
    kept = next(iter(sched._cache._entries.values())).past.blocks
    second = first + completion + [30, 31, 32]
    during = []
    on_step(engine, monkeypatch, {2: lambda: during.append((list(sched._state.slot_blocks),
                                                            [sched._pool.refs[b] for b in kept[:2]],
                                                            sched.stats["kv_blocks_shared"]))})
    assert_full_forward(lm64, second, run_turn(sched, second, 2))
    (slots, refs, shared), = during
    assert slots == [kept[:2] + slots[0][2:]] and refs == [2, 2]
    assert shared == 2  # the kept blocks (a slot holds its blocks once for all its rows)
    holders = {}
    for entry in settled(sched)._cache._entries.values():
        assert len(entry.past.blocks) == blocks_for(len(entry.ids))
        for b in entry.past.blocks:
            holders[b] = holders.get(b, 0) + 1
    assert sched.stats["kv_blocks_used"] == len(holders)
    assert all(sched._pool.refs[b] == n for b, n in holders.items())
    sched.clear_prefix_cache()
    assert sched.stats["kv_blocks_used"] == 0


def test_a_burst_of_requests_is_prefilled_together(engine, scheduler, lm64, monkeypatch):
    """Requests arriving one by one while nothing decodes join in one prefill once arrivals pause (the quiet time is
    set long here, so that a loaded machine's thread switches do not split the burst); each still decodes its
    prompt's greedy continuation."""
    import posttrain.serve.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "GATHER_QUIET_S", 0.3)
    monkeypatch.setattr(scheduler_module, "GATHER_MAX_S", 30.0)
    sched = scheduler()  # (its one-time checks prefill too)
    prefills = []
    start, add = engine.start_slots, engine.add
    monkeypatch.setattr(engine, "start_slots", lambda *a, **k: prefills.append("start") or start(*a, **k))
    monkeypatch.setattr(engine, "add", lambda *a, **k: prefills.append("add") or add(*a, **k))
    sched.start()
    handles = []
    for prompt in PROMPTS:
        handles.append(sched.submit(prompt, 1, GREEDY))
        time.sleep(0.002)
    for prompt, handle in zip(PROMPTS, handles):
        tokens, _, finish = collect(handle)[0]
        assert (tokens, finish) == greedy(lm64, prompt, 8, engine.eos_ids)
    assert prefills == ["start"]


@pytest.mark.parametrize("gather_max, joined_after", [(30.0, 3), (0.0, 2)])
def test_a_request_arriving_while_rows_decode_joins_after_a_step_without_arrivals(engine, scheduler, lm64, monkeypatch,
                                                                                  gather_max, joined_after):
    """One that arrives before step 2 joins once step 3 has passed with no new arrival (or at once when the first
    waiting request has waited GATHER_MAX_S); both requests' continuations are the greedy ones."""
    import posttrain.serve.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "GATHER_MAX_S", gather_max)
    engine.eos_ids = {10**6}
    sched = scheduler()  # (its one-time checks decode too)
    late, joined_at = {}, []
    count = on_step(engine, monkeypatch, {2: lambda: late.setdefault(0, sched.submit(PROMPTS[1], 1, GREEDY))})
    add = engine.add
    monkeypatch.setattr(engine, "add", lambda *a, **k: joined_at.append(count[0]) or add(*a, **k))
    first = sched.submit(PROMPTS[0], 1, RequestSampling(temperature=0.0, max_tokens=12))
    sched.start()
    assert collect(first)[0][:1] == greedy(lm64, PROMPTS[0], 12, engine.eos_ids)[:1]
    assert collect(late[0])[0][0] == greedy(lm64, PROMPTS[1], 8, engine.eos_ids)[0]
    assert joined_at == [joined_after]
