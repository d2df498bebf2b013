"""The decoding state gains, loses and extends sequences mid-run, and each sequence decodes as it would alone.

References are plain: the model's ordinary forward over each sequence's whole token list at every step (no cache),
greedy argmax or the engine's sampler on those logits, log-probs from a float64 log-softmax. Modes: the eager
loop, the static-buffer loop (what CUDA graphs record) run eagerly on the CPU, and the CUDA graphs on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.rollout.base import SamplingParams
import posttrain.rollout.decode_state as decode_state
from posttrain.rollout.engine import DecodeEngine
import posttrain.rollout.prefill as prefill_module
import posttrain.rollout.prefix_buckets as prefix_buckets
from posttrain.rollout.sampling import next_tokens

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODES = ["eager", "buckets", "static", pytest.param("cuda_graphs", marks=CUDA)]
SAMPLED = SamplingParams(temperature=1.0)


def engine_for(mode, lm, tok, monkeypatch):
    """The engine in `mode` and the model it runs (`lm`, or its copy on the GPU), with small first capacities so
    that the suffix buffers grow mid-run; `buckets`: eager, every prompt width its own bucket of the prefix
    (prefix_buckets.py), however little that saves."""
    if mode == "buckets":
        force_buckets(monkeypatch)
    monkeypatch.setattr(decode_state, "FIRST_CAPACITY", 4)
    monkeypatch.setattr(decode_state, "STATIC_FIRST_CAPACITY", 4)
    device = torch.device("cuda") if mode == "cuda_graphs" else torch.device("cpu")
    model = copy.deepcopy(lm).to(device) if device.type == "cuda" else lm
    engine = DecodeEngine(model, tok, device=device, dtype=torch.float32)
    assert engine.cuda_graphs == (mode == "cuda_graphs")
    engine.static = mode not in ("eager", "buckets")
    return engine, model


def force_buckets(monkeypatch):
    monkeypatch.setattr(prefix_buckets, "BUCKET_COST", 0)
    monkeypatch.setattr(prefix_buckets, "USE_BELOW", 1.0)


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def reference(lm, tokens: list[int], steps: int, generator: torch.Generator | None = None):
    """`steps` tokens after `tokens` by full forwards (greedy, or the engine's sampler with `generator`), and
    their log-probs under the model's distribution (float64)."""
    seq, out, logprobs = list(tokens), [], []
    device = next(lm.parameters()).device
    for _ in range(steps):
        with torch.no_grad():
            logits = lm(input_ids=torch.tensor([seq], device=device)).logits[:, -1].float()
        token = int(logits.argmax(-1)) if generator is None else int(next_tokens(logits, SAMPLED, generator))
        out.append(token)
        logprobs.append(float(torch.log_softmax(logits.double(), -1)[0, token]))
        seq.append(token)
    return out, logprobs


class Run:
    """Drives an engine's state step by step, recording each sequence's tokens and log-probs by id."""

    def __init__(self, engine, lm):
        self.engine, self.lm = engine, lm
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}

    def start(self, prompts, mask, n, max_new):
        self.logits, self.state = self.engine.start(self.lm, prompts, mask, n, max_new)

    def steps(self, count: int, generator: torch.Generator | None = None):
        for _ in range(count):
            logits = self.logits.float()
            token = logits.argmax(-1) if generator is None else next_tokens(logits, SAMPLED, generator)
            lp = torch.log_softmax(logits.double(), -1).gather(-1, token[:, None]).squeeze(1)
            for i, t, p in zip(self.state.ids.tolist(), token.tolist(), lp.tolist()):
                self.tokens.setdefault(i, []).append(t)
                self.logprobs.setdefault(i, []).append(p)
            self.logits = self.engine.step(self.lm, self.state, token)

    def extend(self, seq_id: int, appended: list[int], max_new: int):
        """`appended` after sequence `seq_id`, which becomes the state's last row."""
        others = self.state.ids != seq_id
        logits = self.engine.extend(self.lm, self.state, seq_id, torch.tensor(appended), max_new)
        assert int(self.state.ids[-1]) == seq_id
        self.logits = torch.cat([self.logits[others], logits])


def assert_same(run: Run, seq_id: int, tokens: list[int], logprobs: list[float], skip: int = 0):
    got = run.tokens[seq_id][skip:]
    assert got == tokens, (seq_id, got, tokens)
    torch.testing.assert_close(torch.tensor(run.logprobs[seq_id][skip:]), torch.tensor(logprobs),
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_an_extended_sequence_decodes_as_its_whole_text_from_scratch(lm, tiny_tokenizer, mode, monkeypatch):
    """Two prompts x two samples decode 5 tokens; then one sequence gets 3 tokens appended (a tool's output) and
    all decode 9 more: the extended one gives the greedy tokens and log-probs of its prompt + its 5 tokens + the 3
    appended, decoded from scratch; the others those of their own prompt decoded 14 tokens without a pause."""
    engine, lm = engine_for(mode, lm, tiny_tokenizer, monkeypatch)
    texts = [[5, 17, 33, 2, 9, 41], [71, 8, 12]]
    prompts, mask = left_padded(texts, tiny_tokenizer.pad_token_id)
    run = Run(engine, lm)
    with torch.no_grad():
        run.start(prompts, mask, n=2, max_new=14)
        run.steps(5)
        appended = [44, 3, 19]
        run.extend(1, appended, max_new=9)
        run.steps(9)
    assert run.state.capacity > 4  # the buffers grew mid-run
    whole = texts[0] + run.tokens[1][:5] + appended
    assert_same(run, 1, *reference(lm, whole, 9), skip=5)
    for seq_id, text in ((0, texts[0]), (2, texts[1]), (3, texts[1])):
        assert_same(run, seq_id, *reference(lm, text, 14))


@pytest.mark.parametrize("mode", MODES)
def test_an_extended_sequence_samples_as_its_whole_text_from_scratch(lm, tiny_tokenizer, mode, monkeypatch):
    """One sampled sequence (the engine's sampler, one draw per row and step) extended after 4 tokens: with the
    generator reseeded at the extension, the same draws as sampling its whole text from scratch."""
    engine, lm = engine_for(mode, lm, tiny_tokenizer, monkeypatch)
    prompts, mask = left_padded([[5, 17, 33, 2]], tiny_tokenizer.pad_token_id)
    run = Run(engine, lm)
    with torch.no_grad():
        run.start(prompts, mask, n=1, max_new=12)
        run.steps(4, torch.Generator(engine.device).manual_seed(1))
        appended = [44, 3]
        run.extend(0, appended, max_new=8)
        run.steps(8, torch.Generator(engine.device).manual_seed(2))
    whole = [5, 17, 33, 2] + run.tokens[0][:4] + appended
    assert_same(run, 0, *reference(lm, whole, 8, torch.Generator(engine.device).manual_seed(2)), skip=4)


@pytest.mark.parametrize("mode", ["eager", "buckets"])
def test_parked_sequences_resumed_together_decode_as_their_whole_texts_from_scratch(lm, tiny_tokenizer, mode,
                                                                                    monkeypatch):
    """Three sequences of different lengths are parked at different steps (episodes waiting for their tools) while
    the fourth decodes on; then all three resume in one forward with appended tokens of different counts (their
    pasts and appended tokens padded inside one call) and decode 6 more: each gives the greedy tokens and
    log-probs of its whole text decoded from scratch, and the fourth those of its prompt decoded without a pause.
    Eager mode (parking is how multi-turn episodes run, and they decode eagerly)."""
    engine, lm = engine_for(mode, lm, tiny_tokenizer, monkeypatch)
    texts = [[5, 17, 33, 2, 9, 41], [71, 8, 12], [30, 2, 7, 7, 61], [9, 23]]
    prompts, mask = left_padded(texts, tiny_tokenizer.pad_token_id)
    run = Run(engine, lm)
    with torch.no_grad():
        logits, state = engine.start(lm, prompts, mask, 1, 20, share_prefix=False)
        run.logits, run.state = logits, state
        parked = {}
        for steps, seq_id in ((2, 0), (3, 2), (1, 1)):
            run.steps(steps)
            others = run.state.ids != seq_id
            parked[seq_id] = engine.park(run.state, seq_id)
            run.logits = run.logits[others]
        appended = {0: [44, 3, 19], 1: [8], 2: [12, 12, 40, 5, 6]}
        back = [(i, parked[i], torch.tensor(appended[i])) for i in (2, 0, 1)]
        more = engine.resume_many(lm, run.state, back, max_new=6)
        run.logits = torch.cat([run.logits, more])
        run.steps(6)
    assert run.state.ids.tolist() == [3, 2, 0, 1]
    for i in (0, 1, 2):
        own = len(run.tokens[i]) - 6
        whole = texts[i] + run.tokens[i][:own] + appended[i]
        assert_same(run, i, *reference(lm, whole, 6), skip=own)
    assert_same(run, 3, *reference(lm, texts[3], 12))


@pytest.mark.parametrize("mode", MODES)
def test_sequences_joining_and_leaving_mid_run_leave_the_others_alone(lm, tiny_tokenizer, mode, monkeypatch):
    """Prompts A and B (two samples each) decode 3 tokens; A's rows are removed and a longer prompt C joins (its
    two rows start at the current column, A's prefix is freed, B's is re-padded); after 8 more steps B's rows
    give the tokens of B decoded alone for 11 steps and C's those of C decoded alone for 8."""
    engine, lm = engine_for(mode, lm, tiny_tokenizer, monkeypatch)
    a, b, c = [5, 17, 33], [71, 8, 12, 40], [9, 9, 23, 61, 7, 30, 2]
    prompts, mask = left_padded([a, b], tiny_tokenizer.pad_token_id)
    run = Run(engine, lm)
    with torch.no_grad():
        run.start(prompts, mask, n=2, max_new=11)
        run.steps(3)
        run.state.keep(torch.tensor([2, 3], device=run.state.ids.device))
        run.logits = run.logits[2:]
        c_ids, c_mask = left_padded([c], tiny_tokenizer.pad_token_id)
        joined = engine.add(lm, run.state, c_ids, c_mask, torch.tensor([10, 11]), max_new=8)
        run.logits = torch.cat([run.logits.clone(), joined])
        run.steps(8)
    assert run.state.ids.tolist() == [2, 3, 10, 11]
    assert run.state.prefix_keys[0].shape[0] == 2  # A's prefix freed
    for seq_id in (2, 3):
        assert_same(run, seq_id, *reference(lm, b, 11))
    for seq_id in (10, 11):
        assert_same(run, seq_id, *reference(lm, c, 8))


def test_short_prompts_beside_a_long_one_read_only_their_own_width_and_decode_as_alone(lm, tiny_tokenizer,
                                                                                         monkeypatch):
    """One 300-token prompt and five of 3-9 tokens, two samples each, decode 6 tokens; then the long prompt's rows
    leave and the others decode 6 more. Every sequence gives the greedy tokens and log-probs of its prompt decoded
    alone from scratch, and each step's prefix products read at most the short prompts' widths for the short rows
    (and, once the long rows have left, nothing of the long prompt): at most a quarter of the padded
    6 slots x 300 columns."""
    monkeypatch.setattr(prefix_buckets, "BUCKET_COST", 16)  # a bucket's calls priced for this tiny model
    engine, lm = engine_for("eager", lm, tiny_tokenizer, monkeypatch)
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(3, 200, (k,), generator=g).tolist() for k in (3, 9, 300, 5, 4, 7)]
    prompts, mask = left_padded(texts, tiny_tokenizer.pad_token_id)
    read = []
    real_matmul = torch.matmul

    def columns_read(a, b, *args, **kwargs):  # the prefix products: queries (slots, kv, group * g, d) x keys
        if b.dim() == 4 and b.shape[-2] == lm.config.hidden_size // lm.config.num_attention_heads:
            read.append(b.shape[0] * b.shape[-1])
        return real_matmul(a, b, *args, **kwargs)

    run = Run(engine, lm)
    with torch.no_grad():
        run.start(prompts, mask, n=2, max_new=12)
        monkeypatch.setattr(torch, "matmul", columns_read)
        run.steps(6)
        layers = lm.config.num_hidden_layers
        with_long = sum(read) / (6 * layers)
        run.state.keep(torch.tensor([0, 1, 2, 3, 6, 7, 8, 9, 10, 11]))
        run.logits = run.logits[[0, 1, 2, 3, 6, 7, 8, 9, 10, 11]]
        read.clear()
        run.steps(6)
        without_long = sum(read) / (6 * layers)
        monkeypatch.undo()
    assert with_long <= 300 + 9 * 5  # the long slot alone at 300 columns, the short ones at most their longest
    assert without_long <= 9 * 5
    assert with_long <= 6 * 300 / 4
    for seq_id, text in enumerate(texts):
        for row in (2 * seq_id, 2 * seq_id + 1):
            assert_same(run, row, *reference(lm, text, 6 if seq_id == 2 else 12))


def test_self_check_drives_bucketed_prefill_compaction_and_growth(lm, tiny_tokenizer, monkeypatch):
    """The first call's check runs the loop through the paths a real call takes: more than one prefill bucket, rows
    dropped when they end, suffix buffers grown when full."""
    engine = DecodeEngine(lm, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    calls, kept, grown = [], [], []
    State = decode_state.DecodeState
    real_call, real_keep, real_grow = prefill_module._call, State.keep, State._grow
    monkeypatch.setattr(prefill_module, "_call", lambda *a, **k: calls.append(1) or real_call(*a, **k))
    monkeypatch.setattr(State, "keep", lambda self, keep: kept.append(len(keep)) or real_keep(self, keep))
    monkeypatch.setattr(State, "_grow", lambda self: grown.append(self.capacity) or real_grow(self))
    for static in (False, True):
        calls.clear(), kept.clear(), grown.clear()
        engine.static = static
        assert engine._compare(lm) is None
        assert len(calls) >= 3 and kept and grown, (static, calls, kept, grown)


def test_self_check_finds_a_wrong_compaction(lm, tiny_tokenizer, monkeypatch):
    """A state that drops the wrong rows' keys and values fails the check, so the engine falls back."""
    engine = DecodeEngine(lm, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    real_keep = decode_state.DecodeState.keep
    monkeypatch.setattr(decode_state.DecodeState, "keep", lambda self, keep: real_keep(self, keep.flip(0)))
    assert engine._compare(lm) is not None
    assert engine._check(lm) is False
