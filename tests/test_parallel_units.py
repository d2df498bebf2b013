"""The parts of posttrain.parallel that need no multi-process job: splitting work over ranks and micro-batches,
process layouts, which rank's error a failed job reports, and how a process that joined a process group exits."""

import itertools
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.parallel import ParallelDims
from posttrain.parallel.balance import balanced_parts, contiguous_parts, padded_packs, split_packs
from posttrain.parallel.launch import root_cause


def best_max_sum(weights, k, equal_count):
    """Brute force: the smallest possible heaviest part."""
    n, best = len(weights), float("inf")
    for labels in itertools.product(range(k), repeat=n):
        counts = [labels.count(p) for p in range(k)]
        if equal_count and len(set(counts)) > 1:
            continue
        best = min(best, max(sum(w for w, l in zip(weights, labels) if l == p) for p in range(k)))
    return best


@pytest.mark.parametrize("equal_count", [True, False])
def test_balanced_parts_cover_everything_once_and_come_close_to_the_best(equal_count):
    rng = random.Random(0)
    for _ in range(40):
        k = rng.choice([2, 3])
        n = k * rng.randint(1, 3)
        weights = [rng.randint(1, 50) for _ in range(n)]
        parts = balanced_parts(weights, k, equal_count=equal_count)
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert all(p == sorted(p) for p in parts)
        if equal_count:
            assert {len(p) for p in parts} == {n // k}
        heaviest = max(sum(weights[i] for i in p) for p in parts)
        assert heaviest <= best_max_sum(weights, k, equal_count) * 4 / 3 + 1e-9  # greedy's bound
    assert balanced_parts([9, 1, 1, 1, 1, 9], 2, equal_count=True) == [[0, 1, 3], [2, 4, 5]]  # 11 and 11
    with pytest.raises(ValueError, match="equal count"):
        balanced_parts([1, 2, 3], 2, equal_count=True)


def padded(rows, prompt_lens, response_lens):
    """Positions of a forward over `rows`: every row padded to the longest prompt plus the longest response."""
    if not rows:
        return 0
    longest_prompt, longest_response = 0, 0
    for i in rows:
        longest_prompt, longest_response = max(longest_prompt, prompt_lens[i]), max(longest_response, response_lens[i])
    return len(rows) * (longest_prompt + longest_response)


def test_contiguous_parts():
    assert contiguous_parts(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]


def test_token_budget_bounds_padded_positions_not_real_tokens():
    """4 rows of 4,000 tokens and 60 of 250 under an 8,000 budget: the long rows go two by two and the short ones
    32 at a time, never a long row padding short ones (that would be micro-batches of 64,000 positions)."""
    prompt_lens, response_lens = [0] * 64, [4000] * 4 + [250] * 60
    parts = split_packs(padded_packs(prompt_lens, response_lens, 8000), 0, prompt_lens, response_lens)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert sorted(len(p) for p in parts) == [2, 2, 28, 32]
    assert max(padded(p, prompt_lens, response_lens) for p in parts) == 8000
    # a row over the budget alone gets a micro-batch of its own; prompt and response widths pad separately
    assert padded_packs([0, 0, 0], [10, 3, 3], 8) == [[0], [1, 2]]
    assert sorted(map(sorted, padded_packs([5, 1, 1], [1, 5, 1], 12))) == [[0], [1, 2]]  # rows 0 and 1: 2 x (5 + 5) > 12


def test_token_budget_micro_batches_stay_in_budget_at_any_count():
    """Another rank may need more micro-batches: splitting further keeps every one within the budget, covers every
    row once, and leaves empty micro-batches only when rows run out."""
    rng = random.Random(1)
    for _ in range(200):
        n, budget = rng.randint(1, 30), rng.randint(10, 200)
        prompt_lens = [rng.randint(0, 40) for _ in range(n)]
        response_lens = [rng.randint(1, 60) for _ in range(n)]
        packs = padded_packs(prompt_lens, response_lens, budget)
        for count in (len(packs), len(packs) + rng.randint(1, 5)):
            parts = split_packs(packs, count, prompt_lens, response_lens)
            assert len(parts) == count and sorted(i for p in parts for i in p) == list(range(n))
            assert all(p == sorted(p) for p in parts)
            assert all(padded(p, prompt_lens, response_lens) <= budget or len(p) == 1 for p in parts)
            assert sum(1 for p in parts if not p) == max(0, count - n)


def test_model_runner_micro_batches_forward_within_the_token_budget():
    """What a forward computes on (rows x trimmed width, roles.common.trimmed) stays within the token budget
    for left-padded prompts and right-padded responses of very different lengths."""
    from posttrain.data.batch import Batch
    from posttrain.parallel import Parallel
    from posttrain.roles.common import ModelRunner, trimmed

    prompt_w, response_w = 64, 3950
    prompt_real = [50] * 4 + [10] * 60
    response_real = [3950] * 4 + [240] * 60  # rows of 4,000 and 250 tokens
    n = len(prompt_real)
    prompt_mask = torch.zeros(n, prompt_w, dtype=torch.long)
    response_mask = torch.zeros(n, response_w, dtype=torch.long)
    for i in range(n):
        prompt_mask[i, prompt_w - prompt_real[i]:] = 1
        response_mask[i, : response_real[i]] = 1
    batch = Batch({"prompts": torch.ones(n, prompt_w, dtype=torch.long), "responses": torch.ones(n, response_w,
                                                                                                  dtype=torch.long),
                   "input_ids": torch.ones(n, prompt_w + response_w, dtype=torch.long),
                   "attention_mask": torch.cat([prompt_mask, response_mask], 1), "response_mask": response_mask},
                  {"uid": [str(i) for i in range(n)]})
    runner = ModelRunner(torch.nn.Linear(1, 1), Parallel(), dtype=torch.float32)
    parts = runner.micro_parts(batch, None, max_tokens=8000)
    assert sorted(i for p in parts for i in p) == list(range(n))
    sizes = [trimmed(batch.select(p))[0].numel() for p in parts]
    assert max(sizes) <= 8000, sizes
    assert len(parts) == 4  # 2 x 4,000 twice, then 32 and 28 rows of 250 (prompts padded to 10, not 50)


def test_parallel_dims():
    assert ParallelDims.of(8, tp=2) == ParallelDims(dp_replicate=1, dp_shard=4, tp=2)
    dims = ParallelDims.of(16, fsdp_size=4, tp=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp, dims.world) == (2, 4, 2, 8, 16)
    with pytest.raises(ConfigError, match="tp_size=3 must divide the 8 processes"):
        ParallelDims.of(8, tp=3)
    with pytest.raises(ConfigError, match="fsdp_size=3 must divide the 4 data-parallel"):
        ParallelDims.of(8, fsdp_size=3, tp=2)
    dims = ParallelDims.of(8, sp=2)
    assert (dims.dp_shard, dims.sp, dims.dp, dims.world) == (4, 2, 4, 8)
    with pytest.raises(ConfigError, match="with fsdp_config.tp_size=2: not supported"):
        ParallelDims.of(8, tp=2, sp=2)


def test_sequence_parallel_refuses_models_it_cannot_split():
    """Heads that do not divide over the sequence-parallel ranks, and layers that are not full attention, are
    refused at load with the reason."""
    from types import SimpleNamespace

    from posttrain.parallel.ulysses import check_model

    check_model(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible"):
        check_model(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2), 4)
    with pytest.raises(ValueError, match="sliding_attention"):
        check_model(SimpleNamespace(num_attention_heads=4, num_key_value_heads=2,
                                    layer_types=["full_attention", "sliding_attention"]), 2)


def test_the_reported_failure_is_the_rank_that_broke_first():
    def failure(ts, message, code=1):
        return SimpleNamespace(timestamp=ts, message={"message": message}, exitcode=code)

    # same second: rank 0 only lost its connection to rank 1, which raised the real error
    failures = {0: failure(100, "DistBackendError: [gloo] Connection closed by peer"),
                1: failure(100, "RuntimeError: reward module broken")}
    assert root_cause(failures) == (1, "RuntimeError: reward module broken", 1)
    # the rank that broke was stamped a second later (no error file: stamped when the launcher polled)
    failures[1] = failure(101, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    assert root_cause(failures)[0] == 1
    failures[0] = failure(99, "ValueError: bad row")  # between errors of their own, the earlier one wins
    assert root_cause(failures)[0] == 0
    # every rank lost a connection (the one that started it was killed elsewhere): the earliest
    failures = {0: failure(100, "Connection closed by peer"), 1: failure(99, "Connection reset by peer")}
    assert root_cause(failures)[0] == 1
    # the rank the launcher stopped with SIGTERM after rank 1 broke is not the cause
    failures = {0: failure(100, "Signal 15 (SIGTERM) received by PID 7", code=-15),
                1: failure(100, "DistBackendError: [gloo] Connection closed by peer")}
    assert root_cause(failures)[0] == 1


def test_under_torchrun_the_config_takes_its_layout_before_it_is_checked(monkeypatch):
    from argparse import Namespace

    from posttrain.cli import _load

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = Namespace(config=None, overrides=["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                             "actor_rollout_ref.actor.fsdp_config.tp_size=2"])
    cfg = _load(args)  # tp_size=2 fits the 2 processes torchrun started, though the keys were left at 1 x 1
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 2)
    with pytest.raises(ConfigError, match="data.train_batch_size=3 x rollout.n=1 responses must be divisible by the 2"):
        _load(Namespace(config=None, overrides=["data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]))
    with pytest.raises(ConfigError, match="torchrun started 2 processes .* trainer.n_gpus_per_node=4 = 4"):
        _load(Namespace(config=None, overrides=["trainer.n_gpus_per_node=4"]))


EXIT_SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from posttrain.parallel import context
out, join = Path(sys.argv[1]), sys.argv[2] == "join"
if join:
    context.init_parallel(device_name="cpu", need_sharding=True)  # a one-process group of its own
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # never shut down: its idle worker must not hold the exit
pool.submit(time.sleep, 0.1)
print("no newline", end="")
context.shutdown()
context.exit_process(3)
"""


@pytest.mark.parametrize("joined", [True, False], ids=["process group", "none"])
def test_exit_process_keeps_the_exit_code_handlers_threads_and_output(tmp_path, joined):
    """A process that joined a process group ends without the interpreter's teardown (gloo's worker threads race
    it); what the teardown would do first still happens: other threads finished (an idle thread pool's too), exit
    handlers run, output flushed."""
    result = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), "join" if joined else "plain"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    # torch 2.9's gloo prints its own connection line to stdout
    ours = "".join(line for line in result.stdout.splitlines(keepends=True) if not line.startswith("[Gloo] "))
    assert ours == "no newline"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"


GENERATION_THEN_FORWARD = """
import json, sys
import torch
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM
from posttrain.parallel.context import init_parallel, shutdown
from posttrain.parallel.shard import ShardSettings, decoder_layers, gathered_for_generation, parallelize

par = init_parallel(device_name="cpu", need_sharding=True)
out = {}
for reshard in (False, True):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, intermediate_size=32))
    layers = decoder_layers(model)
    parallelize(model, par, ShardSettings(reshard_after_forward=reshard))
    ids = torch.randint(0, 64, (2, 5))

    def layers_kept_gathered():
        loss = model(input_ids=ids).logits.sum()
        kept = [not any(isinstance(p, DTensor) for p in layer.parameters()) for layer in layers]
        loss.backward()
        return kept

    before = layers_kept_gathered()
    with torch.no_grad(), gathered_for_generation(model):
        model(input_ids=ids)
    out[str(reshard)] = {"before": before, "after": layers_kept_gathered()}
shutdown()
print(json.dumps(out))
"""


def test_generation_keeps_each_layers_reshard_after_forward():
    """fsdp_config.reshard_after_forward=False keeps a layer's gathered weights after the training forward, before
    and after a generation (which gathers every layer for decoding and frees them at the end); True frees them."""
    result = subprocess.run([sys.executable, "-c", GENERATION_THEN_FORWARD], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["False"] == {"before": [True, True], "after": [True, True]}
    assert out["True"] == {"before": [False, False], "after": [False, False]}


def test_packed_token_budget_bounds_real_tokens():
    """Packed (`use_remove_padding`): 4 rows of 4,000 tokens and 60 of 250 under an 8,000 budget fill four
    micro-batches of at most 8,000 real tokens, the forward's whole size (no padding)."""
    from posttrain.parallel.balance import token_packs

    lengths = [4000] * 4 + [250] * 60
    parts = token_packs(lengths, 8000)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert len(parts) == 4 and max(sum(lengths[i] for i in p) for p in parts) == 8000
    assert token_packs([10, 3, 3], 8) == [[0], [1, 2]]  # a row over the budget alone
    rng = random.Random(2)
    for _ in range(100):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 30))]
        budget = rng.randint(10, 200)
        packs = token_packs(lengths, budget)
        for count in (len(packs), len(packs) + 3):
            parts = split_packs(packs, count, [0] * len(lengths), lengths,
                                size=lambda rows: sum(lengths[i] for i in rows))
            assert len(parts) == count and sorted(i for p in parts for i in p) == list(range(len(lengths)))
            assert all(sum(lengths[i] for i in p) <= budget or len(p) == 1 for p in parts)


def test_a_step_s_responses_split_over_ranks_whole_prompts_first_then_samples():
    """Each data-parallel rank's runs of (prompt, first sample, samples): whole prompts when they divide evenly,
    otherwise a contiguous share of the (prompt, sample) pairs; every pair once, in prompt order over the ranks,
    as many on each rank. The prompt rows a rank generates from, and where a straddled prompt's first sample lies."""
    from posttrain.parallel import Parallel, ParallelDims
    from posttrain.parallel.samples import first_sample_rows, prompt_rows

    def runs(prompts, n, dp):
        out = []
        for rank in range(dp):
            par = Parallel(ParallelDims(dp_shard=dp))
            par.dp_rank = rank
            out.append(par.my_samples(prompts, n))
        return out

    assert runs(4, 3, 2) == [[(0, 0, 3), (1, 0, 3)], [(2, 0, 3), (3, 0, 3)]]
    assert runs(1, 4, 2) == [[(0, 0, 2)], [(0, 2, 2)]]
    assert runs(3, 4, 2) == [[(0, 0, 4), (1, 0, 2)], [(1, 2, 2), (2, 0, 4)]]
    for prompts, n, dp in ((8, 16, 64), (128, 16, 256), (16, 16, 32), (3, 4, 2)):
        shares = runs(prompts, n, dp)
        pairs = [(p, s) for share in shares for p, first, count in share for s in range(first, first + count)]
        assert pairs == [(p, s) for p in range(prompts) for s in range(n)], (prompts, n, dp)
        assert len({sum(c for *_, c in share) for share in shares}) == 1
    assert prompt_rows([(0, 0, 3), (1, 0, 3)], 3) == ([0, 1], 3)
    assert prompt_rows([(1, 2, 2), (2, 0, 4)], 4) == ([1, 1, 2, 2, 2, 2], 1)
    assert first_sample_rows([(1, 2, 2), (2, 0, 4)], ["a", "b"]) == [(2, "b")]
    assert first_sample_rows([(0, 0, 4), (1, 0, 2)], ["a", "b"]) == [(0, "a"), (4, "b")]


_PAGE_FAULTS_PER_STEP = """
import resource, sys, torch
from posttrain.host_memory import keep_freed_memory
from posttrain.parallel import init_parallel
init_parallel(device_name="cpu")  # a CPU process: tunes glibc unless told not to
counts = []
for _ in range(8):  # steps whose activations (3 x 48 MiB, every page written) are all freed at the end
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activations = [torch.ones(12 * 2**20) for _ in range(3)]
    del activations
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(keep_freed_memory(), *counts)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_cpu_process_reuses_freed_pages_unless_told_not_to():
    """Within a few steps, a step's activations reuse the pages the step before freed (none faulted in again),
    where glibc alone maps and unmaps blocks over 32 MiB every time (36,864 pages a step here);
    POSTTRAIN_KEEP_FREED_MEMORY=0 or the process's own MALLOC_ variable leaves glibc as it is."""
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")

    def run(**env):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
        out = subprocess.run([sys.executable, "-c", _PAGE_FAULTS_PER_STEP], capture_output=True, text=True,
                             env=clean | env, check=True).stdout.split()
        return out[0] == "True", [int(c) for c in out[1:]]

    tuned, counts = run()
    assert tuned and max(counts[-2:]) < 1000, counts
    for opt_out in ({"POSTTRAIN_KEEP_FREED_MEMORY": "0"}, {"MALLOC_ARENA_MAX": "2"}):
        tuned, counts = run(**opt_out)
        assert not tuned, opt_out
