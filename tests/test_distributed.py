"""Several processes give the same update as one: the same fixed batch through `RLTrainer.learn` (old/ref log-probs,
values, advantages, critic and actor updates) in 1 process, in 2 (FSDP2), with tensor parallel 2, on a 2 x 2
FSDP x TP mesh and with hybrid sharding (4 processes each), compared metric by metric and weight by weight (LoRA: FSDP only; with tensor parallel
it is rejected at load). Real torch.distributed (gloo, CPU).

Tolerances: fp32 throughout; sums taken in another order differ by float rounding, so losses, gradient norms and
log-probs must agree to 1e-5 relative (plus 1e-6 absolute). The gradients of every optimizer step and the updated
weights are compared with the bounds derived in tests/same_update.py: gradients to rounding, weights within what
Adam's step can make of a gradient within rounding of zero."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.same_update import ADAM_STEP, assert_same_gradients, assert_same_training, assert_same_weights


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
WORKER = Path(__file__).with_name("dist_worker.py")
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CASES = {
    # padded rows with shared prompts here; packed rows (use_remove_padding, the default) in the other cases
    **{f"grpo_kl_{m}": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                        "actor_rollout_ref.actor.entropy_coeff=0.01", f"actor_rollout_ref.actor.loss_agg_mode={m}",
                        "actor_rollout_ref.model.use_remove_padding=False"]
       for m in MODES},
    **{f"ppo_{m}": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "algorithm.use_kl_in_reward=True",
                    f"actor_rollout_ref.actor.loss_agg_mode={m}"] for m in MODES},
    "grpo_token_budget_shuffled": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_dynamic_bsz=True",
                                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=60",
                                   "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
                                   "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=90",
                                   "actor_rollout_ref.actor.shuffle=True", "actor_rollout_ref.actor.ppo_epochs=2"],
    # FSDP2's CPU offload of actor and reference, Adam state offloaded between steps (one plain process: no-ops)
    "grpo_kl_offload": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
                        "actor_rollout_ref.ref.fsdp_config.param_offload=True"],
    "grpo_lora_kl": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.model.lora_rank=4",
                     "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.use_kl_loss=True",
                     "actor_rollout_ref.actor.optim.lr=1e-3"],
}
METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl",
           "critic/vf_loss", "critic/grad_norm", "critic/vf_clipfrac", "critic/advantages/mean", "critic/returns/mean",
           "critic/values/mean", "critic/rewards/mean", "actor/reward_kl_penalty")
SCORE_BY_LENGTH = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    """A reward that varies between episodes: the parity of the response's length in characters."""
    return {"score": float(len(solution_str) % 2)}
'''


@pytest.fixture(scope="module")
def fixed_batch(tmp_path_factory, tiny_model_dir, tiny_tokenizer):
    """8 prompts x 4 sampled responses of the tiny model, scored at random (seeded), and a data file naming them."""
    from posttrain.data.dataset import layout_row
    from posttrain.models.load import load_causal_lm
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.transformers_generate import TransformersGenerate
    from tests.test_roles_rollout import prompts_batch

    out = tmp_path_factory.mktemp("dist")
    rows = [layout_row("synthetic/arithmetic", f"{a}+{a + 3}=", str(2 * a + 3), {"index": a}) for a in range(8)]
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    torch.manual_seed(0)
    engine = TransformersGenerate(load_causal_lm(str(tiny_model_dir)), tiny_tokenizer, device=torch.device("cpu"),
                                  dtype=torch.float32)
    batch = engine.generate(prompts_batch(tiny_tokenizer, [r["prompt"][0]["content"] for r in rows]),
                            SamplingParams(n=4, max_new_tokens=8))
    n = len(batch)
    scores = (torch.rand(n) > 0.5).float()
    token_scores = torch.zeros(batch["responses"].shape)
    token_scores[torch.arange(n), batch["response_mask"].sum(-1) - 1] = scores
    batch["token_level_scores"] = token_scores
    batch.meta.update({"data_source": ["synthetic/arithmetic"] * n, "ground_truth": ["0"] * n,
                       "extra_info": [{}] * n, "reward:acc": scores.tolist(), "reward:score": scores.tolist()})
    torch.save(batch, out / "batch.pt")
    return out


def run_layout(fixed_batch, tiny_model_dir, name: str, nproc: int, extra: list[str], count_gathers=False,
               cases: dict | None = None, timeout: int = 900, **spec_extra) -> Path:
    out = fixed_batch / name
    out.mkdir(exist_ok=True)
    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={fixed_batch / 'train.jsonl'}",
            "data.train_batch_size=8", "data.max_prompt_length=64", "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.optim.lr=1e-4",
            "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False", "trainer.logger=['jsonl']",
            f"trainer.default_local_dir={out / 'run'}", f"trainer.n_gpus_per_node={nproc}", *extra]
    cases = cases or {k: v for k, v in CASES.items() if "lora" not in k or "tp_size" not in " ".join(extra)}
    spec = {"base": base, "cases": cases, "batch": str(fixed_batch / "batch.pt"), "out": str(out),
            "count_gathers": count_gathers, **spec_extra}
    return run_worker(spec, out, nproc, timeout)


def run_worker(spec: dict, out: Path, nproc: int, timeout: int = 900) -> Path:
    """dist_worker.py on `spec` (written to OUT/spec.json): alone for one process, else under torchrun; `out`."""
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = ([sys.executable, str(WORKER), str(out / "spec.json")] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER),
            str(out / "spec.json")])
    result = run_processes(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout)
    assert result.returncode == 0, first_and_last(result.stderr)
    return out


def first_and_last(stderr: str, each: int = 3000) -> str:
    """The start and the end of a failed job's output. The rank that failed first says why at the start (a C++
    abort's message, the Python stack faulthandler prints); the other ranks' tracebacks ("Connection closed by
    peer") and torchrun's summary come after it, and fill the end."""
    return stderr if len(stderr) <= 2 * each else f"{stderr[:each]}\n[...]\n{stderr[-each:]}"


def run_processes(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """`cmd`, stopped with its workers (torchrun ends them on SIGTERM) if it runs past `timeout`: a hang. A
    process that dies of a signal (an abort in gloo's threads) prints each of its threads' Python stack."""
    env = {"PYTHONFAULTHANDLER": "1", **env}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
        raise AssertionError(f"still running after {timeout} s (a hang?): {stderr[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def one_process(fixed_batch, tiny_model_dir):
    return run_layout(fixed_batch, tiny_model_dir, "one", 1, [])


def assert_same_update(reference: Path, other: Path, min_cases: int = 9, same_paths: bool = True):
    cases = json.loads((other / "spec.json").read_text())["cases"]
    assert len(cases) >= min_cases
    for case in cases:
        want, got = torch.load(reference / f"{case}.pt"), torch.load(other / f"{case}.pt")
        for key in METRICS:
            if key in want["metrics"]:
                assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), (case, key)
        # the models that share prompts or pack rows in one process do so when sharded too (no fast path lost)
        if same_paths:
            assert got["shared"] == want["shared"], (case, got["shared"], want["shared"])
        for key in ("old_log_probs", "ref_log_probs", "values"):
            if want[key] is not None:
                assert torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-6), (case, key)
        assert_same_training(want, got, case)


def test_two_processes_equal_one(fixed_batch, tiny_model_dir, one_process):
    two = run_layout(fixed_batch, tiny_model_dir, "fsdp2", 2, [], count_gathers=True)
    assert_same_update(one_process, two)
    assert any(torch.load(two / f"{case}.pt")["shared"].get("actor") for case in CASES)
    for case, overrides in CASES.items():  # the sharded models ran packed rows wherever use_remove_padding is on
        paths = torch.load(two / f"{case}.pt")["shared"]
        assert bool(paths["actor_packed"]) == ("actor_rollout_ref.model.use_remove_padding=False" not in overrides)
        assert paths.get("critic_packed") is (True if case.startswith("ppo") else None), case
    gathers = json.loads((two / "gathers.json").read_text())
    # generation gathers each FSDP unit once, however many tokens it decodes
    assert gathers["counts"][0] == gathers["counts"][1] <= gathers["units"], gathers


def test_a_prompt_group_straddling_two_ranks_gives_the_update_of_one_process(fixed_batch, tiny_model_dir):
    """ppo_mini_batch_size=1 on 2 ranks: each mini-batch is one group of 4 responses, 2 on each rank. The advantages
    come from the gathered batch and the losses are normalised over the whole mini-batch, so the update equals one
    process's, metric by metric and weight by weight (actor, and the critic of PPO)."""
    cases = {k: CASES[k] for k in ("grpo_kl_token-mean", "grpo_kl_seq-mean-token-mean", "ppo_seq-mean-token-sum")}
    mini = ["actor_rollout_ref.actor.ppo_mini_batch_size=1"]
    one = run_layout(fixed_batch, tiny_model_dir, "straddle_one", 1, mini, cases=cases)
    two = run_layout(fixed_batch, tiny_model_dir, "straddle_two", 2, mini, cases=cases)
    assert_same_update(one, two, min_cases=3)


STRADDLED_STEPS = {
    # 1 prompt x 4 greedy samples: 2 on each rank; the critic, KL in the reward
    "ppo_n4": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "algorithm.use_kl_in_reward=True",
               "actor_rollout_ref.rollout.n=4"],
    # 1 prompt x 6, micro-batches of 2: 3 samples on each rank, in generation and in the update
    "grpo_n6": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.rollout.n=6",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"],
    # ReMax's greedy baseline: each rank decodes it for the prompt its samples belong to
    "remax_n4": ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=4"],
}


def run_straddled_step(fixed_batch, tiny_model_dir, name: str, nproc: int) -> Path:
    out = fixed_batch / name
    out.mkdir(exist_ok=True)
    (out / "reward.py").write_text(SCORE_BY_LENGTH)
    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={fixed_batch / 'train.jsonl'}",
            "data.train_batch_size=1", "data.shuffle=False", "data.max_prompt_length=64",
            "data.max_response_length=8", "actor_rollout_ref.rollout.do_sample=False",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.actor.optim.lr=1e-4", "actor_rollout_ref.model.dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            f"custom_reward_function.path={out / 'reward.py'}", "reward_model.num_workers=0",
            "trainer.logger=['jsonl']", f"trainer.default_local_dir={out / 'run'}", f"trainer.n_gpus_per_node={nproc}"]
    return run_worker({"base": base, "cases": STRADDLED_STEPS, "out": str(out), "steps": "single"}, out, nproc)


def test_one_prompt_s_samples_straddle_two_ranks_in_generation_and_the_step_equals_one_process(fixed_batch,
                                                                                              tiny_model_dir):
    """Fewer prompts per step than data-parallel ranks (1 prompt on 2 ranks): each rank generates its share of the
    prompt's samples (2 and 2 of 4, 3 and 3 of 6), the gathered batch is laid out as in one process (the prompt's
    responses together, under its uid), and the greedy step equals one process's: batch, metrics, gradients and
    weights (actor, and PPO's critic)."""
    one = run_straddled_step(fixed_batch, tiny_model_dir, "straddled_one", 1)
    two = run_straddled_step(fixed_batch, tiny_model_dir, "straddled_two", 2)
    for case, overrides in STRADDLED_STEPS.items():
        n = int(next(o for o in overrides if "rollout.n=" in o).rsplit("=", 1)[1])
        sampled = [[c for c in json.loads((two / f"{case}_generated_rank{r}.json").read_text())
                    if not c["uids"][0].startswith("greedy")] for r in range(2)]  # (not ReMax's baseline)
        rows = [sum(len(c["uids"]) * c["n"] for c in calls) for calls in sampled]
        assert rows == [n // 2, n // 2], (case, sampled)
        assert all(u == "s1-0" for calls in sampled for c in calls for u in c["uids"]), (case, sampled)
        want, got = torch.load(one / f"{case}.pt", weights_only=False), torch.load(two / f"{case}.pt",
                                                                                   weights_only=False)
        assert got["uid"] == want["uid"] == ["s1-0"] * n
        for key in ("input_ids", "attention_mask", "response_mask", "token_level_scores"):
            assert torch.equal(got["tensors"][key], want["tensors"][key]), (case, key)
        if "remax" in case:
            assert torch.equal(got["tensors"]["reward_baselines"], want["tensors"]["reward_baselines"])
        for key in METRICS:
            if key in want["metrics"]:
                assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), (case, key)
        assert_same_training(want, got, case)


def test_lora_from_a_saved_adapter_on_two_ranks_equals_one_process(fixed_batch, tiny_model_dir, tmp_path):
    """`model.lora_adapter_path`: rank 0 loads the saved adapter's weights, the other rank builds its structure and
    receives them; the update equals one process's, and starts from the saved weights (not a fresh adapter)."""
    from posttrain.models.load import LoraSettings, load_causal_lm

    torch.manual_seed(5)
    model = LoraSettings(4, 8, "q_proj,v_proj").apply(load_causal_lm(str(tiny_model_dir)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    model.save_pretrained(tmp_path / "adapter")
    cases = {"grpo_lora_adapter": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
                                   f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}",
                                   "actor_rollout_ref.actor.optim.lr=1e-3"]}
    one = run_layout(fixed_batch, tiny_model_dir, "adapter_one", 1, [], cases=cases)
    two = run_layout(fixed_batch, tiny_model_dir, "adapter_two", 2, [], cases=cases)
    assert_same_update(one, two, min_cases=1)
    for run in (one, two):  # before any update, the saved B matrices already move the policy off the reference
        got = torch.load(run / "grpo_lora_adapter.pt")  # (a fresh adapter starts at B = 0: the two would be equal)
        assert (got["old_log_probs"] - got["ref_log_probs"]).abs().max() > 1e-4


def test_ranks_take_one_path_when_a_fast_path_check_fails_on_one_rank_only(fixed_batch, tiny_model_dir):
    """The one-time checks of the packed and shared-prompt passes (actor, reference, critic) and of the decoding
    engine fail on rank 1 only: every rank keeps the plain path, and the step (generate, then learn) finishes instead of hanging in
    a sharded forward whose collectives no longer pair up."""
    out = run_layout(fixed_batch, tiny_model_dir, "one_rank_fails", 2, [], cases={"ppo": CASES["ppo_token-mean"]},
                     timeout=300, fail_checks_on_rank=1)
    checks = [json.loads((out / f"ppo_checks_rank{rank}.json").read_text()) for rank in range(2)]
    assert checks[0] == checks[1] == {"actor": False, "reference": False, "critic": False, "rollout": False,
                                      "actor_packed": False, "reference_packed": False, "critic_packed": False}, checks


def test_sharded_policy_makes_the_same_calls_whether_or_not_a_ranks_rows_share_prompts(tmp_path, tiny_model_dir):
    """Rank 0's micro-batch shares no prompt, rank 1's does (as token-budget micro-batches can fall): both ranks take
    the shared-prompt pass, so their sharded forwards and backwards pair up, and each gets the plain forward's
    log-probs."""
    from posttrain.models.load import load_causal_lm
    from posttrain.models.policy import PolicyModel

    rows = two_ranks_rows()
    run_rows_on_two_ranks(tmp_path, tiny_model_dir, rows)
    plain = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    for rank, (ids, mask, _) in enumerate(rows):
        with torch.no_grad():
            want, _ = plain(ids, mask, 4)
        torch.testing.assert_close(torch.load(tmp_path / f"rows_rank{rank}.pt"), want, atol=1e-5, rtol=1e-5)


def two_ranks_rows() -> list:
    """Per rank (ids, mask, uids) of 4 rows: rank 0's share no prompt, rank 1's rows 0-1 and 2-3 share theirs."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for uids in (["a", "b", "c", "d"], ["a", "a", "b", "b"]):
        ids = torch.randint(5, 100, (4, 12), generator=gen)
        if uids[1] == "a":  # rows 0-1 and 2-3 share their 8-token prompt
            ids[1, :8], ids[3, :8] = ids[0, :8], ids[2, :8]
        rows.append((ids, torch.ones_like(ids), uids))
    return rows


def run_rows_on_two_ranks(tmp_path: Path, tiny_model_dir, rows: list, **spec_extra) -> list[dict]:
    """`rows` through dist_worker's `rows_of_each_rank` on two ranks; what each rank's checks decided."""
    torch.save(rows, tmp_path / "rows.pt")
    spec = {"model": str(tiny_model_dir), "rows": str(tmp_path / "rows.pt"), "response_length": 4,
            "out": str(tmp_path), **spec_extra}
    run_worker(spec, tmp_path, 2, timeout=120)
    return [json.loads((tmp_path / f"rows_checks_rank{rank}.json").read_text()) for rank in (0, 1)]


def test_fsdp_mixed_precision_keeps_the_fast_paths_through_half_precision_rounding(tmp_path, tiny_model_dir):
    """Sharded in bf16 (FSDP's MixedPrecisionPolicy casts the weights and leaves autocast off), the one-time checks
    judge the packed and shared-prompt paths at half precision's tolerance, as one process under autocast is judged:
    two exact kernels differ there by rounding (on a GPU, torch's varlen kernel against padded sdpa), and a
    difference of 1e-3 keeps both fast paths on both ranks. Judged at float32's 1e-4, as they were, every sharded
    bf16 run fell back to padded rows and unshared prompts. The log-probs are the plain float32 forward's to bf16's
    precision."""
    from posttrain.models.load import load_causal_lm
    from posttrain.models.policy import PolicyModel

    rows = two_ranks_rows()
    checks = run_rows_on_two_ranks(tmp_path, tiny_model_dir, rows, mixed_precision=True, packed=True,
                                   check_difference=1e-3)
    assert checks == [{"shared": True, "packed": True}] * 2
    plain = PolicyModel(load_causal_lm(str(tiny_model_dir)))
    for rank, (ids, mask, _) in enumerate(rows):
        with torch.no_grad():
            want, _ = plain(ids, mask, 4)
        torch.testing.assert_close(torch.load(tmp_path / f"rows_rank{rank}.pt"), want, atol=0.1, rtol=0.02)


def test_tensor_parallel_two_equals_one(fixed_batch, tiny_model_dir, one_process):
    tp = run_layout(fixed_batch, tiny_model_dir, "tp2", 2, ["actor_rollout_ref.actor.fsdp_config.tp_size=2"])
    assert_same_update(one_process, tp)


SEQUENCE_PARALLEL_CASES = ("ppo_token-mean", "ppo_seq-mean-token-sum-norm", "grpo_token_budget_shuffled",
                           "grpo_kl_offload", "grpo_lora_kl")


def test_sequence_parallel_two_equals_one(fixed_batch, tiny_model_dir, one_process):
    """ulysses_sequence_parallel_size=2 on 2 processes (one data-parallel rank, each packed micro-batch split along
    the sequence, heads exchanged all-to-all around attention): the old/ref log-probs, values, metrics, every
    gradient of actor and critic and the updated weights equal one process's."""
    cases = {k: CASES[k] for k in SEQUENCE_PARALLEL_CASES}
    sp = run_layout(fixed_batch, tiny_model_dir, "sp2", 2, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
                    cases=cases)
    assert_same_update(one_process, sp, min_cases=len(cases), same_paths=False)
    for case in cases:  # every trained model ran packed rows, split over the two ranks (heads exchanged)
        got = torch.load(sp / f"{case}.pt")
        assert got["shared"]["actor_packed"]
        assert got["shared"].get("critic_packed") is (True if case.startswith("ppo") else None)
        assert got["all_to_all"] > 0, case


# The 4-process layouts run each kind of case once: padded and packed rows, two loss aggregations (token and
# sequence normalisation), the critic, token budgets, offload and LoRA; the 2-process tests run all four aggregations
# of both estimators. (All eleven cases on 4 processes took 25 s for HSDP and 48 s for FSDP x TP on 2 cores.)
FOUR_PROCESS_CASES = {k: CASES[k] for k in ("grpo_kl_token-mean", "grpo_kl_seq-mean-token-mean", "ppo_token-mean",
                                            "ppo_seq-mean-token-sum-norm", "grpo_token_budget_shuffled",
                                            "grpo_kl_offload", "grpo_lora_kl")}


def test_hybrid_sharding_equals_one(fixed_batch, tiny_model_dir, one_process):
    """fsdp_size=2 of 4 processes: shard within pairs, replicate across them (HSDP)."""
    hsdp = run_layout(fixed_batch, tiny_model_dir, "hsdp", 4, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2"],
                      cases=FOUR_PROCESS_CASES)
    assert_same_update(one_process, hsdp, min_cases=7)


def test_fsdp_by_tp_mesh_equals_one(fixed_batch, tiny_model_dir, one_process):
    """tp_size=2 of 4 processes: FSDP over the pairs' tensor-parallel halves (LoRA is refused with TP)."""
    mesh = run_layout(fixed_batch, tiny_model_dir, "fsdp2_tp2", 4, ["actor_rollout_ref.actor.fsdp_config.tp_size=2",
                                                                      "trainer.balance_batch=False"],
                      cases={k: v for k, v in FOUR_PROCESS_CASES.items() if "lora" not in k})
    assert_same_update(one_process, mesh, min_cases=6)


# ---------------------------------------------------------------- on-policy distillation


def distillation_cases(teacher: Path, student: Path) -> dict:
    """On-policy distillation against a different (randomly re-initialised) teacher: a reverse-KL estimator as a
    loss and as a reward through the PPO loss beside the task's, the top-k forward KL, and two teachers routed by
    data source (every row of the fixed batch goes to the second one, a copy of the student)."""
    one = [f"distillation.teacher_models.teacher_model.model_path={teacher}"]
    two = [f"distillation.teacher_models.t1.model_path={teacher}", "distillation.teacher_models.t1.key=other",
           f"distillation.teacher_models.t2.model_path={student}",
           "distillation.teacher_models.t2.key=synthetic/arithmetic"]
    on = ["algorithm.adv_estimator=grpo", "distillation.enabled=True", "actor_rollout_ref.actor.ppo_epochs=2"]
    loss = "distillation.distillation_loss."
    return {
        "opd_k3_loss": on + one + [f"{loss}use_task_rewards=False"],
        "opd_k1_reward_with_task": on + one + [f"{loss}loss_mode=k1", f"{loss}use_policy_gradient=True",
                                               f"{loss}distillation_loss_coef=0.5"],
        "opd_topk": on + one + [f"{loss}loss_mode=forward_kl_topk", f"{loss}topk=4",
                                f"{loss}log_prob_min_clamp=-30"],
        "opd_two_teachers": on + two + [f"{loss}loss_mode=k3"],
    }


DISTILL_METRICS = ("actor/distillation/loss", "actor/distillation/abs_loss", "actor/distillation/student_mass",
                   "actor/distillation/teacher_mass", "actor/distillation/pg_clipfrac", "actor/pg_loss",
                   "actor/grad_norm")


def test_distillation_two_processes_equal_one(fixed_batch, tiny_model_dir, lively_model_dir):
    """The teacher's scores (sampled-token and top-k log-probs and ids), the distillation metrics, gradients and
    weights of a 2-process run (teacher and student sharded over both) equal those of one process. Rows go to the
    teacher their data source names: the student's copy scores them as the student does."""
    cases = distillation_cases(lively_model_dir, tiny_model_dir)
    one = run_layout(fixed_batch, tiny_model_dir, "opd_one", 1, [], cases=cases)
    two = run_layout(fixed_batch, tiny_model_dir, "opd_two", 2, [], cases=cases)
    for case in cases:
        want, got = torch.load(one / f"{case}.pt"), torch.load(two / f"{case}.pt")
        assert want["metrics"]["actor/distillation/loss"] != 0, case
        for key in DISTILL_METRICS:
            if key in want["metrics"]:
                assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), (case, key)
        for key in ("teacher_log_probs", "teacher_topk_log_probs"):
            if want[key] is not None:
                assert torch.allclose(got[key], want[key], rtol=1e-5, atol=1e-6), (case, key)
        if want["teacher_topk_ids"] is not None:
            assert torch.equal(got["teacher_topk_ids"], want["teacher_topk_ids"]), case
        assert_same_training(want, got, case)
    routed = torch.load(one / "opd_two_teachers.pt")
    assert torch.allclose(routed["teacher_log_probs"], routed["old_log_probs"], atol=1e-5)


# ---------------------------------------------------------------- reward extras that only some ranks return

EXTRA_KEY_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    """A code-like scorer beside a math-like one: only the rows marked "code" report a pass rate."""
    if extra_info.get("code"):
        return {"score": 1.0, "pass_rate": 0.25}
    return {"score": 0.0}
'''


def test_reward_key_returned_on_one_rank_only_is_kept_and_averaged_over_its_rows(tmp_path, tiny_model_dir):
    """Two processes: at step 1 only rank 0's rows return `pass_rate`, at step 2 only rank 1's. The key set is the
    union over the ranks (no KeyError, no metric lost), `reward/pass_rate/mean` is the mean over the rows that have
    it (0.25, not diluted by the rows without it), and gdpo reads it as a component (0 where a row lacks it)."""
    from posttrain.data.dataset import layout_row

    rows = [layout_row("synthetic/arithmetic", f"{a}+1=", str(a + 1), {"index": a, "code": a in (0, 3)})
            for a in range(4)]  # train_batch_size=2, no shuffle: step 1 = rows 0 (rank 0), 1 (rank 1); step 2 = 2, 3
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(EXTRA_KEY_REWARD)
    run = tmp_path / "run"
    args = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path / 'train.jsonl'}",
            "data.train_batch_size=2", "data.shuffle=False", "data.max_prompt_length=64", "data.max_response_length=4",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False", "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[score,pass_rate]", f"custom_reward_function.path={tmp_path / 'reward.py'}",
            "reward_model.num_workers=0", "trainer.total_training_steps=2", "trainer.val_before_train=False",
            "trainer.n_gpus_per_node=2", "trainer.logger=['jsonl']", f"trainer.default_local_dir={run}"]
    result = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", *args], capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["reward/pass_rate/mean"] == pytest.approx(0.25), m
        assert m["critic/score/mean"] == pytest.approx(0.5), m  # 2 of the 4 responses score 1


# ------------------------------------------------------------------ the bounds themselves (no processes)


def _adamw_run(grads: list[torch.Tensor], start: torch.Tensor, lr: float) -> torch.Tensor:
    """`start` after one AdamW step (posttrain's defaults) per gradient."""
    w = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.01)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    return w.detach()


def test_update_bounds_accept_rounding_and_reject_a_wrong_gradient():
    """Two runs whose gradients differ by summation order only (relative 1e-7, and a few coordinates within rounding
    of zero whose sign flips) are the same update, though Adam sends those coordinates a good part of a step apart —
    more than a fixed 1e-5 bound on weights allows (what failed on an AVX2-only CPU). A gradient off by a factor of 2
    (a normaliser off by the world size) is not, though Adam's first step leaves all but a few weights where the right
gradient puts them."""
    gen = torch.Generator().manual_seed(0)
    lr, n = 1e-3, 100_000
    start = torch.randn(n, generator=gen) * 0.1
    grads = [torch.randn(n, generator=gen) * 1e-2 for _ in range(2)]
    for g in grads:
        g[:10] = 3e-9  # within rounding of zero: as large as Adam's eps
    reordered = [g * (1 + 1e-7 * torch.randn(n, generator=gen)) for g in grads]
    for g in reordered:
        g[:10] = -3e-9  # the other summation order lands on the other side of zero

    def run(gs):
        steps = [{"lr": lr, "grads": {"w": g}} for g in gs]
        return steps, {"w": _adamw_run(gs, start, lr)}

    (want_steps, want_w), (got_steps, got_w) = run(grads), run(reordered)
    diffs = (got_w["w"] - want_w["w"]).abs()
    assert diffs.max() > 1e-5  # the old check (every weight within 1e-5) fails on rounding
    assert diffs.max() <= 2 * ADAM_STEP * 2 * lr  # within two of Adam's steps per step
    assert_same_gradients(want_steps, got_steps, "reordered")
    assert_same_weights(want_w, got_w, want_steps, "reordered")

    doubled_steps, _ = run([2 * g for g in grads])
    first_step = _adamw_run([2 * grads[0]], start, lr) - _adamw_run([grads[0]], start, lr)
    assert (first_step.abs() > 1e-6).double().mean() < 1e-3  # weights barely see it: only coordinates near eps
    with pytest.raises(AssertionError):
        assert_same_gradients(want_steps, doubled_steps, "doubled")
    with pytest.raises(AssertionError):
        assert_same_weights(want_w, {"w": want_w["w"] + 2 * lr}, want_steps, "every weight a step apart")


STOP_SCRIPT = """
import json, sys
from posttrain.parallel.context import exit_process, init_parallel, shutdown
from posttrain.trainer.preempt import StopOnSignal
par = init_parallel(device_name="cpu", tp=2)  # 2 processes, one tensor-parallel pair: a single data-parallel rank
stop = StopOnSignal()
stop.signum = 15 if par.rank == 1 else None  # the signal reached rank 1 only
answer = {"agreed": stop.agreed(par), "dp_max": par.max(par.rank)}
with open(f"{sys.argv[1]}/rank{par.rank}.json", "w") as f:  # a file each: two ranks' prints can share a line
    json.dump(answer, f)
shutdown()
exit_process(0)  # as `posttrain` ends: no interpreter teardown racing gloo's worker threads
"""


def test_a_signal_on_one_rank_of_a_tensor_parallel_pair_stops_both(tmp_path):
    """The stop decision is a max over every rank of the job, not over the data-parallel ranks only: a rank that
    stopped while its tensor-parallel peer went on would leave the peer waiting in the next step's collectives."""
    script = tmp_path / "stop.py"
    script.write_text(STOP_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(tmp_path)]
    result = run_processes(cmd, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    answers = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(a["agreed"] for a in answers) == [15, 15]
    assert sorted(a["dp_max"] for a in answers) == [0, 1]  # the data-parallel max alone would not have agreed
