"""Keys and values in blocks: the pool's accounting, and the paged decoding state against its definition.

A paged state's logits must be the model's own: at every step each row's logits equal a float64 full forward over
its whole token list (no cache), whatever joins, leaves, shares its prompt or resumes from a kept sequence. Block
accounting is checked against counts re-derived from the token lengths (ceil(L / 16) blocks per sequence)."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.kv_blocks import BLOCK, BlockPool, BlockSequence

# ------------------------------------------------------------------ the pool


def test_blocks_are_reference_counted_and_return_to_the_free_list():
    pool = BlockPool(2, 1, 4, dtype=torch.float32, device="cpu", first_blocks=4)
    a = pool.allocate(3)
    assert pool.used == 3 and pool.free == 1 and pool.shared == 0
    pool.ref(a[:2])
    assert pool.shared == 2
    pool.release(a)
    assert pool.used == 2 and pool.shared == 0
    pool.release(a[:2])
    assert pool.used == 0 and pool.free == 4
    with pytest.raises(RuntimeError, match="free already"):
        pool.release(a[:1])


def test_the_pool_grows_when_its_free_list_runs_out_and_keeps_what_it_held():
    pool = BlockPool(1, 1, 2, dtype=torch.float32, device="cpu", first_blocks=2)
    held = pool.allocate(2)
    pool.keys[0][:, held] = torch.arange(2 * BLOCK * 2, dtype=torch.float32).view(1, 2, BLOCK, 2)
    more = pool.allocate(3)
    assert pool.total >= 5 and pool.grown >= 1 and not set(held) & set(more)
    assert torch.equal(pool.keys[0][:, held].flatten(), torch.arange(2 * BLOCK * 2, dtype=torch.float32))


def test_copy_on_write_leaves_the_other_holders_keys_untouched():
    pool = BlockPool(2, 1, 2, dtype=torch.float32, device="cpu", first_blocks=2)
    (b,) = pool.allocate(1)
    for layer in range(2):
        pool.keys[layer][:, b] = 1.0 + layer
    pool.ref([b])
    mine = pool.writable(b)
    assert mine != b and pool.refs[b] == 1 and pool.refs[mine] == 1
    for layer in range(2):
        assert torch.equal(pool.keys[layer][:, mine], pool.keys[layer][:, b])
        pool.keys[layer][:, mine, 3] = -5.0
        assert bool((pool.keys[layer][:, b] == 1.0 + layer).all())
    assert pool.writable(mine) == mine  # held alone: written in place


def test_a_sequence_gathers_its_positions_in_order():
    pool = BlockPool(1, 1, 1, dtype=torch.float32, device="cpu", first_blocks=4)
    blocks = pool.allocate(3)[::-1]  # not in id order
    for i, b in enumerate(blocks):
        pool.keys[0][0, b, :, 0] = torch.arange(BLOCK) + i * BLOCK
    seq = BlockSequence(pool, blocks, 2 * BLOCK + 5)
    keys, _ = seq.gather()
    assert keys[0].shape == (1, 1, 2 * BLOCK + 5, 1)
    assert keys[0].flatten().tolist() == list(range(2 * BLOCK + 5))
    part = seq.prefix(BLOCK + 1)
    assert part.blocks == blocks[:2] and pool.refs[blocks[0]] == 3  # allocated, seq, part
    part.release()
    seq.release()
    pool.release(blocks)
    assert pool.used == 0


# ------------------------------------------------------------------ the paged state decodes as the model does


@pytest.fixture(scope="module")
def lm64(lm):
    return copy.deepcopy(lm).double()


@pytest.fixture
def engine(lm, tiny_tokenizer):
    engine = DecodeEngine(lm, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    engine.ready()
    return engine


class Paged:
    """Drives a paged state greedily, checking every row's logits against the float64 full forward of its tokens."""

    def __init__(self, engine, lm, lm64):
        self.engine, self.lm, self.lm64 = engine, lm, lm64
        self.state, self.logits, self.seqs, self.worst = None, None, [], 0.0

    def join(self, prompts, group, copies, rows, pasts=None):
        """Prompts (token lists) join: `copies` slots each, `rows` rows per slot."""
        if pasts is None:
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        else:
            ids, mask = [torch.tensor(p[pasts[i].length:]) for i, p in enumerate(prompts)], None
        copies, rows = torch.tensor(copies), torch.tensor(rows)
        per_slot = [p for p, c in zip(prompts, copies.tolist()) for _ in range(c)]
        seqs = [list(p) for p, r in zip(per_slot, rows.tolist()) for _ in range(r)]
        with torch.no_grad(), self.engine.decoding(self.lm):
            if self.state is None:
                self.logits, self.state = self.engine.start_slots(self.lm, ids, mask, group, 0, copies=copies,
                                                                  rows=rows, pasts=pasts, paged=True)
            else:
                logits = self.engine.add(self.lm, self.state, ids, mask, torch.arange(len(seqs)) + 100, 0,
                                         copies=copies, rows=rows, pasts=pasts)
                self.logits = torch.cat([self.logits, logits])
        self.seqs += seqs

    def steps(self, count):
        for _ in range(count):
            self._check()
            token = self.logits.argmax(-1)
            for s, t in zip(self.seqs, token.tolist()):
                s.append(t)
            with torch.no_grad(), self.engine.decoding(self.lm):
                self.logits = self.engine.step(self.lm, self.state, token)
        self._check()

    def keep(self, rows):
        self.state.keep(torch.tensor(rows, dtype=torch.long))
        self.logits = self.logits[rows]
        self.seqs = [self.seqs[j] for j in rows]

    def _check(self):
        with torch.no_grad():
            for j, seq in enumerate(self.seqs):
                want = self.lm64(input_ids=torch.tensor([seq])).logits[0, -1]
                error = float((self.logits[j].double() - want).abs().max() / want.abs().max())
                self.worst = max(self.worst, error)
        assert self.worst < 1e-4, self.worst


def lengths_blocks(lengths):
    return sum(-(-n // BLOCK) for n in lengths)


PROMPTS = [[5 + (i * 7) % 240 for i in range(n)] for n in (20, 7, 33, 16)]


def test_paged_rows_sharing_prompts_joining_and_leaving_decode_as_the_full_forward(engine, lm, lm64):
    """Prompts of 20, 7 and 33 tokens with 2, 1 and 3 samples (slots of up to 2 rows, the 3 samples in two slots
    holding the same prompt blocks) decode 20 steps (each crossing a block boundary); rows leave mid-run; a prompt of
    exactly one block joins late with 2 samples; every step's logits are the full forward's."""
    run = Paged(engine, lm, lm64)
    run.join(PROMPTS[:3], group=2, copies=[1, 1, 2], rows=[2, 1, 2, 1])
    state, pool = run.state, run.state.pool
    # the third prompt: 2 whole blocks held by its 2 slots, 1 partial block shared by its 3 rows (not yet written)
    assert pool.refs[state.slot_blocks[2][0]] == 2 and state.slot_blocks[2] == state.slot_blocks[3]
    assert pool.refs[state.own[3][0]] == 3 and state.own[3] == state.own[5]
    run.steps(6)
    assert state.copies_on_write == 3  # each prompt's partial block: copied by all its rows but the last to write
    run.keep([0, 2, 4])
    run.steps(3)
    run.join([PROMPTS[3]], group=2, copies=[1], rows=[2])
    run.steps(12)
    assert pool.used == len(state.held_blocks())
    state.release()
    assert pool.used == 0


def test_a_short_row_joining_beside_a_long_one_holds_only_its_own_blocks(engine, lm, lm64):
    """A 200-token prompt decodes 40 steps; a 3-token prompt joins and decodes 4: it holds 1 block (its 3 + 4
    positions), the long one ceil(240 / 16); nothing is reserved for either's future tokens."""
    long_prompt = [3 + (i * 11) % 240 for i in range(200)]
    run = Paged(engine, lm, lm64)
    run.join([long_prompt], group=1, copies=[1], rows=[1])
    with torch.no_grad(), engine.decoding(lm):
        for _ in range(40):
            token = run.logits.argmax(-1)
            run.seqs[0].append(int(token))
            run.logits = engine.step(lm, run.state, token)
    run.join([[7, 8, 9]], group=1, copies=[1], rows=[1])
    run.steps(4)
    state = run.state
    short = state.slot_blocks[state.slot_of[1]] + state.own[1]
    assert len(short) == 1
    assert len(state.slot_blocks[state.slot_of[0]] + state.own[0]) == -(-(200 + 40 + 4 + 1) // BLOCK)
    assert state.pool.used == lengths_blocks([200 + 45, 3 + 5])  # each with its next write's position
    state.release()


def test_a_prompt_resuming_a_kept_sequence_references_its_blocks_and_decodes_as_the_full_forward(engine, lm, lm64):
    """A finished row's sequence is kept (its blocks held); a prompt extending its first 37 positions joins with
    2 samples: it references the kept sequence's 2 whole blocks (no copy), copies the partial third, and decodes as
    the full forward of its whole text; once everything is released no block is held."""
    run = Paged(engine, lm, lm64)
    run.join([PROMPTS[2]], group=2, copies=[1], rows=[1])
    run.steps(10)
    kept = run.state.sequence(0)
    text = list(run.seqs[0])  # every token appended was decoded
    assert kept.length == len(text) == 43
    run.keep([])
    pool = kept.pool
    assert pool.used == lengths_blocks([43])  # the kept sequence only
    prefix = kept.prefix(37)
    run.join([text[:37] + [9, 10, 11, 12]], group=2, copies=[1], rows=[2], pasts=[prefix])
    prefix.release()
    state = run.state
    assert state.slot_blocks[0] == kept.blocks[:2] and pool.refs[kept.blocks[0]] == 2
    assert kept.blocks[2] not in state.held_blocks()
    run.steps(5)
    kept.release()
    state.release()
    assert pool.used == 0


def copy_matches_blocks(state):
    """Each row's working copy (its slot's lane, then its own columns) holds exactly its blocks' positions."""
    for j in range(len(state.slot_of)):
        keys, values = state.past(j)
        lane, shared = state.lane_of[state.slot_of[j]], len(state.slot_blocks[state.slot_of[j]]) * BLOCK
        own = state.own_length[j]
        for layer in range(len(keys)):
            for copy_, (prefix, rows) in zip((keys[layer][0], values[layer][0]),
                                             ((state.prefix_keys, state.keys), (state.prefix_values, state.values))):
                held = torch.cat([prefix[layer][lane, :, :shared], rows[layer][j, :, :own]], dim=1)
                assert torch.equal(held, copy_)


def test_reused_lanes_and_columns_do_not_leak_earlier_rows_keys(engine, lm, lm64):
    """Long prompts decode, then leave; shorter prompts join into the lanes they freed (over their longer keys) and
    into own columns that shrank; every step's logits are still the full forward's, and each row's working copy
    holds exactly its blocks' positions."""
    long_prompts = [[3 + (i * 11 + k) % 240 for i in range(70)] for k in range(3)]
    run = Paged(engine, lm, lm64)
    run.join(long_prompts, group=1, copies=[1, 1, 1], rows=[1, 1, 1])
    run.steps(40)  # own columns grow past 40
    state = run.state
    lanes_before, columns_before = state._lanes[0].shape[0], state.keys[0].shape[2]
    freed = {state.lane_of[state.slot_of[j]] for j in (0, 1)}
    run.keep([2])
    assert state.keys[0].shape[2] == columns_before  # the remaining row still needs them
    run.join([PROMPTS[0], PROMPTS[2]], group=1, copies=[1, 1], rows=[1, 1])
    assert {state.lane_of[state.slot_of[j]] for j in (1, 2)} == freed and state._lanes[0].shape[0] == lanes_before
    run.steps(3)
    copy_matches_blocks(state)
    run.keep([1, 2])  # the long row leaves: the own columns shrink
    assert state.keys[0].shape[2] < columns_before
    run.join([PROMPTS[1]], group=1, copies=[1], rows=[1])
    run.steps(20)
    copy_matches_blocks(state)
    state.release()
    assert state.pool.used == 0


def test_parking_a_paged_row_gives_its_keys_and_values_in_order(engine, lm, lm64):
    """`past` of a paged row equals the keys and values a plain forward over its tokens computes."""
    run = Paged(engine, lm, lm64)
    run.join([PROMPTS[0]], group=2, copies=[1], rows=[2])
    run.steps(3)
    keys, values = run.state.past(1)
    with torch.no_grad():
        out = lm(input_ids=torch.tensor([run.seqs[1]]), use_cache=True)
    for layer, (k, v) in enumerate(zip(keys, values)):
        torch.testing.assert_close(k, out.past_key_values.layers[layer].keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(v, out.past_key_values.layers[layer].values, rtol=0, atol=1e-5)
    run.state.release()


def test_the_paged_self_check_passes_and_finds_a_write_into_a_shared_block(lm, tiny_tokenizer, monkeypatch):
    """The engine's check of the paged state passes on the model; with copy-on-write broken (a row writes into the
    partly filled prompt block its sibling reads) it fails, and a server then decodes on the contiguous state."""
    from posttrain.serve.scheduler import Scheduler

    engine = DecodeEngine(lm, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    assert engine.check_paged()
    broken = DecodeEngine(lm, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)
    monkeypatch.setattr(BlockPool, "writable", lambda self, block: block)
    assert not broken.check_paged()
    scheduler = Scheduler(broken)
    assert not scheduler.paged
    scheduler.close()
