"""Several processes give the same episodes and the same update as one: multi-turn episodes (the environment
answering between turns), whole multi-turn steps with each prompt's episodes on its rank, with tensor parallel, and
agent programs over the OpenAI-compatible server on each rank. Real torch.distributed (gloo, CPU); the layouts, the
worker and the tolerances are tests/test_distributed.py's."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.test_distributed import (METRICS, SCORE_BY_LENGTH, assert_same_update, run_layout, run_processes,
                                    run_worker)
from tests.same_update import assert_same_training

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------- multi-turn episodes

MULTI_TURN = ["actor_rollout_ref.rollout.multi_turn.enable=True",
              "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
              "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=disable",
              "actor_rollout_ref.rollout.agent.default_agent_loop=guess_number"]
EPISODE_CASES = {
    "grpo_kl": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.entropy_coeff=0.01"],
    "grpo_seq_mean_token_mean": ["algorithm.adv_estimator=grpo",
                                 "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
    "ppo": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "algorithm.use_kl_in_reward=True"],
    "grpo_token_budget_shuffled": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_dynamic_bsz=True",
                                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=400",
                                   "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
                                   "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=500",
                                   "actor_rollout_ref.actor.shuffle=True", "actor_rollout_ref.actor.ppo_epochs=2"],
}


def guess_rows(path: Path, n: int, seed: int) -> Path:
    """`n` guess_number rows, each its own range (1..9+i): prompts, and so greedy episodes, differ."""
    from posttrain.agents.envs.guess_number import guess_number_rows

    rows = [guess_number_rows(1, 1, 9 + i, seed=seed + i, max_guesses=3)[0] for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def episode_batch(tmp_path_factory, tiny_model_dir, tiny_tokenizer):
    """8 guess_number prompts x 4 sampled episodes of the tiny model (turns end within a few tokens; the
    environment answers between them), scored at random (seeded) on each episode's last policy token."""
    from posttrain.agents.loop import EpisodeRunner
    from posttrain.agents.rollout import run_episodes
    from posttrain.agents.settings import AgentSettings
    from posttrain.data.batch import Batch
    from posttrain.models.load import load_causal_lm
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.engine import DecodeEngine
    from tests.dist_worker import short_turns

    out = tmp_path_factory.mktemp("episodes")
    rows = [json.loads(line) for line in guess_rows(out / "train.jsonl", 8, 0).read_text().splitlines()]
    engine = DecodeEngine(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer, device=torch.device("cpu"),
                          dtype=torch.float32)
    runner = EpisodeRunner(engine, tiny_tokenizer, AgentSettings(tokenization_sanity_check_mode="disable",
                                                                 max_assistant_turns=3))
    short_turns(runner)
    prompts = Batch({"prompts": torch.zeros(8, 1, dtype=torch.long), "prompt_mask": torch.ones(8, 1, dtype=torch.long)},
                    {"uid": [f"s1-{i}" for i in range(8)], "data_source": [r["data_source"] for r in rows],
                     "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
                     "extra_info": [r["extra_info"] for r in rows], "raw_prompt": [r["prompt"] for r in rows],
                     "agent_name": [r["agent_name"] for r in rows]})
    torch.manual_seed(0)
    batch = run_episodes(runner, prompts, SamplingParams(n=4, max_new_tokens=40, logprobs=True))
    n = len(batch)
    mask = batch["response_mask"]
    assert (mask == 0).logical_and(batch["response_attention_mask"] == 1).any()  # holes: appended messages
    assert len({int(w) for w in batch["response_attention_mask"].sum(-1)}) > 4  # episodes of many lengths
    scores = (torch.rand(n) > 0.5).float()
    last = torch.tensor([int(torch.nonzero(row).max()) for row in mask])
    batch["token_level_scores"] = torch.zeros(mask.shape)
    batch["token_level_scores"][torch.arange(n), last] = scores
    batch.meta.update({"reward:acc": scores.tolist(), "reward:score": scores.tolist()})
    torch.save(batch, out / "batch.pt")
    return out


def test_two_processes_equal_one_on_multi_turn_episodes(episode_batch, tiny_model_dir):
    """The same multi-turn batch (policy tokens, then appended environment messages the mask leaves out, episodes
    of many lengths) through `learn` in 1 and 2 processes: the same losses, log-probs, values, gradients and
    weights — each rank's share of the rows has its own widths, and the masks' holes are counted alike."""
    extra = ["data.max_prompt_length=256", "data.max_response_length=40", *MULTI_TURN]
    one = run_layout(episode_batch, tiny_model_dir, "one", 1, extra, cases=EPISODE_CASES)
    two = run_layout(episode_batch, tiny_model_dir, "fsdp2", 2, extra, cases=EPISODE_CASES)
    assert_same_update(one, two, min_cases=len(EPISODE_CASES))


def run_multi_turn_steps(tmp_path, model_dir, name: str, nproc: int, cases: dict, extra: tuple = (),
                         **spec_extra) -> Path:
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    (tmp_path / "reward.py").write_text(SCORE_BY_LENGTH)
    base = [f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files={guess_rows(tmp_path / 'train.jsonl', 8, 0)}",
            f"data.val_files={guess_rows(tmp_path / 'val.jsonl', 4, 1)}", "data.val_batch_size=3",
            "data.train_batch_size=4", "data.shuffle=False", "data.max_prompt_length=256",
            "data.max_response_length=160", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.optim.lr=1e-4",
            "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.model.dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            f"custom_reward_function.path={tmp_path / 'reward.py'}", "reward_model.num_workers=0",
            "trainer.logger=['jsonl']", f"trainer.default_local_dir={out / 'run'}", f"trainer.n_gpus_per_node={nproc}",
            *MULTI_TURN, *extra]
    return run_worker({"base": base, "cases": cases, "out": str(out), "steps": True, **spec_extra}, out, nproc)


STEP_CASES = {
    "ppo_greedy": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "algorithm.use_kl_in_reward=True",
                   "actor_rollout_ref.rollout.do_sample=False"],
    # the greedy baseline's episodes are greedy (the same in any layout); the sampled ones differ per data rank
    "remax": ["algorithm.adv_estimator=remax"],
    "dapo": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=True",
             "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=4"],
}


@pytest.fixture(scope="module")
def multi_turn_one(tmp_path_factory, lively_model_dir):
    return run_multi_turn_steps(tmp_path_factory.mktemp("steps"), lively_model_dir, "one", 1, STEP_CASES)


def assert_same_greedy_step(want: dict, got: dict, case: str) -> None:
    """The same episodes, row by row, and the same update."""
    assert got["uid"] == want["uid"]
    for key in ("input_ids", "attention_mask", "response_mask", "response_attention_mask"):
        assert torch.equal(got["tensors"][key], want["tensors"][key]), (case, key)
    for key in METRICS:
        if key in want["metrics"]:
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), (case, key)
    assert_same_training(want, got, case)


def test_multi_turn_steps_run_each_prompt_s_episodes_on_its_rank_and_equal_one_process(tmp_path, lively_model_dir,
                                                                                       multi_turn_one):
    """Whole steps on guess_number episodes in 1 and 2 processes: each rank runs the episodes of its own share of
    the prompts (validation: 2 and 1 of a chunk of 3, then 1 and none), the gathered batch holds every episode in
    prompt order, row by row its own episode, though the ranks' episodes have different widths. Greedy rollouts
    (PPO; ReMax's baseline) are the same as in one process, and so is the update; ReMax and DAPO's dynamic
    sampling (which draws more batches until enough groups vary) run on episodes."""
    one, two = multi_turn_one, run_multi_turn_steps(tmp_path, lively_model_dir, "two", 2, STEP_CASES)
    for case in STEP_CASES:
        ran = [json.loads((two / f"{case}_ran_rank{r}.json").read_text()) for r in range(2)]
        alone = json.loads((one / f"{case}_ran_rank0.json").read_text())
        for calls in ran:  # training (and ReMax's greedy baseline: the same prompts), then validation
            train = [c["uids"] for c in calls if not c["uids"][0].startswith("v")]
            assert all(len(uids) == 2 for uids in train), (case, calls)
        assert ran[0][0]["uids"][0].endswith("-0") and ran[1][0]["uids"][0].endswith("-2"), (case, ran)
        val = [[c["uids"] for c in calls if c["uids"][0].startswith("v")] for calls in ran]
        assert val == [[["v0-0", "v0-1"], ["v3-0"]], [["v0-2"]]], (case, val)  # uids: chunk start, index
        if case != "dapo":  # (dynamic sampling draws as many batches as its sampled groups need)
            mine = sorted(u for calls in ran for c in calls for u in c["uids"] if not u.startswith("greedy"))
            assert mine == sorted(u for c in alone for u in c["uids"] if not u.startswith("greedy")), case
        want, got = torch.load(one / f"{case}.pt", weights_only=False), torch.load(two / f"{case}.pt",
                                                                                   weights_only=False)
        assert max(got["turns"]) > 1, (case, got["turns"])  # the environment answered and the policy went on
        if case == "dapo":
            assert got["metrics"]["batch/kept_prompts"] % 2 == 0
            continue
        if case == "remax":
            assert torch.equal(got["tensors"]["reward_baselines"], want["tensors"]["reward_baselines"])
            continue
        assert_same_greedy_step(want, got, case)
        assert got["val"] == pytest.approx(want["val"], rel=1e-5, abs=1e-6)  # every validation episode, once


def test_multi_turn_step_with_tensor_parallel_equals_one_process(tmp_path, lively_model_dir, multi_turn_one):
    """Two processes of one tensor-parallel pair run the same episodes in lockstep, though one process's
    environment answers late: their batches (sampled too: each row's draw depends on the rows decoding beside it)
    are the same, and the greedy step's episodes and update are one process's."""
    cases = {"ppo_greedy": STEP_CASES["ppo_greedy"], "grpo_sampled": ["algorithm.adv_estimator=grpo"]}
    tp = run_multi_turn_steps(tmp_path, lively_model_dir, "tp2", 2, cases,
                              extra=("actor_rollout_ref.actor.fsdp_config.tp_size=2",), slow_rank=1)
    for case in cases:
        ran = [json.loads((tp / f"{case}_ran_rank{r}.json").read_text()) for r in range(2)]
        assert ran[0] == ran[1] and len(ran[0][0]["uids"]) == 4, ran  # one data rank: both processes run every prompt
        assert torch.equal(torch.load(tp / f"{case}_input_ids_rank0.pt"), torch.load(tp / f"{case}_input_ids_rank1.pt"))
    assert_same_greedy_step(torch.load(multi_turn_one / "ppo_greedy.pt", weights_only=False),
                            torch.load(tp / "ppo_greedy.pt", weights_only=False), "ppo_greedy")


def test_a_tensor_parallel_pair_runs_each_environment_once_and_appends_the_same_tokens(tmp_path, lively_model_dir):
    """Two processes of one tensor-parallel pair, an environment whose tool answer names its process (and so differs
    in length): the environments run on the pair's first process only and the other receives their answers, so both
    hold the same episodes — the first process's tool results, rewards and tool counts — and went on after them
    (before, each process appended its own answer and the pair's collectives no longer matched)."""
    out = run_worker({"tp_episodes": True, "model": str(lively_model_dir), "out": str(tmp_path)}, tmp_path, 2,
                     timeout=300)
    first, second = (json.loads((out / f"tp_episodes_rank{r}.json").read_text()) for r in range(2))
    assert first == second
    tools = [m["content"] for e in first for m in e["messages"] if m["role"] == "tool"]
    assert tools and all(t == "process 0 x" for t in tools)
    assert all(e["reward"] == 0 and e["tool_calls"] >= 1 for e in first)
    assert max(e["turns"] for e in first) > 1


# ------------------------------------------------------------------ agent programs over ranks

RANKED_PROGRAM = '''
import os
from openai import OpenAI

def play(row, base_url, api_key):
    """One chat call; the reward: 1 for an even row index, plus 0.5 when the answer has a digit. Raises on the
    ranks listed in FAIL_RANKS."""
    if os.environ.get("RANK", "0") in os.environ.get("FAIL_RANKS", "").split(","):
        raise RuntimeError("this rank's harness is down")
    reply = OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="policy", messages=row["prompt"], max_tokens=4)
    text = reply.choices[0].message.content or ""
    return float(row["extra_info"]["index"] % 2 == 0) + 0.5 * any(c.isdigit() for c in text)
'''


def program_run(tmp_path: Path, model_dir, name: str, *, processes: int, fail_ranks: str = "", steps: int = 2,
                estimator: str = "grpo"):
    """`posttrain train` of the agent program above on 2 prompts a step (greedy, 2 runs each) in `processes`
    processes: (the finished process, the run folder)."""
    from posttrain.data.dataset import layout_row

    rows = [layout_row("synthetic/arithmetic", f"{a}+1=", str(a + 1), {"index": a}) for a in range(2 * steps)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "ranked_program.py").write_text(RANKED_PROGRAM)
    run = tmp_path / name
    args = [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={tmp_path / 'train.jsonl'}",
            "data.train_batch_size=2", "data.shuffle=False", "data.max_prompt_length=64", "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.do_sample=False",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"algorithm.adv_estimator={estimator}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.model.dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32",
            f"actor_rollout_ref.rollout.agent.program={tmp_path / 'ranked_program.py'}:play",
            "actor_rollout_ref.rollout.agent.program_timeout_s=60", "reward_model.num_workers=0",
            f"trainer.total_training_steps={steps}", "trainer.val_before_train=False",
            f"trainer.n_gpus_per_node={processes}", "trainer.logger=['jsonl']", f"trainer.default_local_dir={run}",
            f"trainer.rollout_data_dir={run / 'rollouts'}"]
    result = run_processes([sys.executable, "-m", "posttrain.cli", "train", *args],
                           {**os.environ, "OMP_NUM_THREADS": "1", "FAIL_RANKS": fail_ranks}, timeout=600)
    return result, run


def test_a_rank_whose_programs_all_fail_trains_on_the_other_ranks_samples_with_the_failures_counted(
        tmp_path, tiny_model_dir):
    """Two processes, every program run on rank 1 raises: no rank waits at the batch gather for ever. Each step
    trains on rank 0's samples (its prompt's two runs) and counts rank 1's two runs as failed."""
    result, run = program_run(tmp_path, tiny_model_dir, "run", processes=2, fail_ranks="1")
    assert result.returncode == 0, result.stderr[-4000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["agent/programs"] == 4 and m["agent/program_errors/raised"] == 2, m
        assert m["agent/program_samples"] == 2, m
    for step, first_prompt in ((1, 0), (2, 2)):  # rank 0 holds the first prompt of each step's two
        dumped = [json.loads(line) for line in (run / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert [d["ground_truth"] for d in dumped] == [str(first_prompt + 1)] * 2, dumped


def test_programs_that_fail_on_every_rank_stop_the_run_with_one_error_on_each_rank(tmp_path, tiny_model_dir):
    """Two processes, every program run raises: the run ends (no hang) and both ranks name the cause."""
    result, _ = program_run(tmp_path, tiny_model_dir, "run", processes=2, fail_ranks="0,1", steps=1)
    assert result.returncode != 0
    assert result.stderr.count("no sample on any rank") >= 2, result.stderr[-4000:]


def test_two_processes_equal_one_on_greedy_agent_programs(tmp_path, lively_model_dir):
    """Greedy agent programs in two processes give the gathered batch (each sample's uid, response and score, in
    order) and the update (loss, gradient norm, rewards) of one process: each rank serves its share of the prompts
    and the gather puts them back in prompt order. The rewards differ across prompts and REINFORCE++ normalises
    over the batch, so the update is not zero. fp32 throughout, as the other equal-one tests (`dtype=auto` may pick
    bf16, autocast in one process and FSDP's mixed precision when sharded: close, not equal)."""
    one, one_dir = program_run(tmp_path, lively_model_dir, "one", processes=1, estimator="reinforce_plus_plus")
    two, two_dir = program_run(tmp_path, lively_model_dir, "two", processes=2, estimator="reinforce_plus_plus")
    assert one.returncode == 0, one.stderr[-4000:]
    assert two.returncode == 0, two.stderr[-4000:]
    for step in (1, 2):
        want = (one_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        got = (two_dir / "rollouts" / f"{step}.jsonl").read_text().splitlines()
        assert len(want) == 4 and got == want
        assert len({json.loads(line)["score"] for line in want}) > 1
    metrics = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    for want, got in zip(metrics(one_dir), metrics(two_dir), strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean",
                    "critic/advantages/mean", "response_length/mean", "agent/programs", "agent/program_samples"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert want["actor/grad_norm"] > 0
