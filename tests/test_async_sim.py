"""benchmarks/async_sim.py's simulation against cases worked out by hand: equal response lengths (sigma 0), where
every mode's step time is a sum of a few products."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from async_sim import Costs, Workload, fully_async_mode, generate_batch, pipeline_mode, sync_mode  # noqa: E402

# 4 prompts x 2 responses of exactly 100 tokens, prompts of 10 tokens
W = Workload(prompts=4, n=2, mini_prompts=4, require_batches=1, trigger=1, prompt_len=10, median=100.0, sigma=0.0,
             max_len=1000, max_seqs=64)
TOKENS = 4 * 2 * (100 + 10)


def test_a_batch_decodes_at_step_plus_live_sequences_and_queues_beyond_max_seqs():
    costs = Costs(step=1.0, seq=0.5, prefill=2.0, train_token=0.0, sync=0.0)
    t, idle = generate_batch(costs, 1, [10, 10, 10], max_seqs=8, prompt_len=1)
    # three prefills (one prompt token each), then 10 steps with 3 live
    assert t == pytest.approx(3 * 2.0 + 10 * (1.0 + 3 * 0.5))
    assert idle == pytest.approx(0.0)
    # two slots: two sequences, then the third alone after its prefill
    t, _ = generate_batch(costs, 1, [10, 10, 10], max_seqs=2, prompt_len=1)
    assert t == pytest.approx(2 * 2.0 + 10 * 2.0 + 2.0 + 10 * 1.5)
    # a short and a long sequence on two GPUs: the short one's GPU idles while the long one decodes
    t, idle = generate_batch(Costs(1.0, 0.0, 0.0, 0.0, 0.0), 2, [10, 50], max_seqs=8, prompt_len=1)
    assert (t, idle) == pytest.approx((50.0, 40.0))


def test_sync_step_is_generation_then_training_on_all_gpus():
    costs = Costs(step=0.01, seq=0.001, prefill=0.005, train_token=0.002, sync=7.0)
    r = sync_mode(costs, W, gpus=2, steps=3, rng=random.Random(0))
    # 4 sequences per GPU: prefills, 100 steps with 4 live, then the training tokens split over 2 GPUs
    assert r.step == pytest.approx(4 * 0.005 * 10 + 100 * (0.01 + 4 * 0.001) + 0.002 * TOKENS / 2)
    assert r.gen_idle == pytest.approx(0.0)


def test_one_step_off_overlaps_equal_generation_and_training_into_half_the_serial_step():
    gen = 100 * (1.0 + 8 * 0.0)  # one generating GPU, 8 sequences of 100 tokens, step cost 1
    costs = Costs(step=1.0, seq=0.0, prefill=0.0, train_token=gen / TOKENS, sync=0.0)  # training takes `gen` too
    serial = pipeline_mode(costs, W, 1, 1, steps=40, rng=random.Random(0), off=0)
    overlapped = pipeline_mode(costs, W, 1, 1, steps=40, rng=random.Random(0), off=1)
    assert serial.step == pytest.approx(2 * gen)
    assert overlapped.step == pytest.approx(gen)
    assert serial.step / overlapped.step == pytest.approx(2.0)
    assert overlapped.train_idle < 0.05 and serial.train_idle == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("partial", [True, False])
def test_fully_async_with_staleness_0_takes_the_serial_time_on_the_split_gpus(partial):
    """staleness_threshold 0 and one update per sync of the whole batch: generate, train, sync, in turn."""
    costs = Costs(step=0.01, seq=0.001, prefill=0.005, train_token=0.002, sync=3.0)
    serial = pipeline_mode(costs, W, 2, 1, steps=6, rng=random.Random(0), off=0)
    r = fully_async_mode(costs, W, 2, 1, steps=6, rng=random.Random(0), staleness=0.0, partial=partial)
    expected = 4 * 0.005 * 10 + 100 * (0.01 + 4 * 0.001) + 0.002 * TOKENS + 3.0
    assert serial.step == pytest.approx(expected)
    assert r.step == pytest.approx(expected)
    assert r.staleness == 0.0


def test_fully_async_with_staleness_1_and_equal_phases_halves_the_step_as_one_step_off_does():
    gen = 100 * 1.0
    costs = Costs(step=1.0, seq=0.0, prefill=0.0, train_token=gen / TOKENS, sync=0.0)
    r = fully_async_mode(costs, W, 1, 1, steps=20, rng=random.Random(0), staleness=1.0)
    assert r.step == pytest.approx(gen)
    assert r.staleness == pytest.approx(1.0, abs=0.1)


def test_train_scaling_prices_training_on_a_share_of_the_gpus():
    """train_scaling 1: half the GPUs train twice as long; 0: as fast as all of them (verl's 64 -> 128 GPUs: 0.23)."""
    costs = Costs(step=1.0, seq=0.0, prefill=0.0, train_token=0.01, sync=0.0)
    for scaling, train in ((1.0, 0.01 * TOKENS / 2 * 2), (0.0, 0.01 * TOKENS / 2), (0.5, 0.01 * TOKENS / 2 * 2**0.5)):
        w = Workload(**{**W.__dict__, "train_scaling": scaling})
        assert sync_mode(costs, w, 2, 2, random.Random(0)).step == pytest.approx(100 * 1.0 + 0.01 * TOKENS / 2)
        assert pipeline_mode(costs, w, 1, 1, 3, random.Random(0), off=0).step == pytest.approx(100 * 1.0 + train)
