"""The command line at several processes, as a user runs it: `posttrain train trainer.n_gpus_per_node=2` starts its
own workers and learns the task as one process does; its checkpoint resumes in 2 processes with the same numbers as
without the stop, loads in 1, and exports to a plain folder that generates the trained policy's greedy text; two
`torchrun --nnodes=2` launches form one job; a failing rank stops every rank with its error."""

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def train_args(small_task, run, *extra):
    out, files = small_task
    return ["algorithm.adv_estimator=grpo", "data.train_batch_size=44", "data.max_prompt_length=32",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=44", "actor_rollout_ref.actor.optim.lr=3e-4",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.model.dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32", f"actor_rollout_ref.model.path={out / 'sft'}",
            f"data.train_files={files['rl_train']}", f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']",
            "trainer.val_before_train=False", *extra]


def posttrain(*args, env=None):
    result = subprocess.run([sys.executable, "-m", "posttrain.cli", *args], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, timeout=900)
    return result


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def strip(m):
    """Training numbers of a step (the straight run also validated at its last step, which the watch's validation
    detector reads)."""
    return {k: round(v, 5) for k, v in m.items()
            if not k.startswith(("timing_s", "perf", "val-", "watch/val_divergence", "watch/parts/val_divergence"))}


@pytest.fixture(scope="module")
def two_process_run(small_task, tmp_path_factory):
    """20 GRPO steps in 2 processes, checkpoints at 10 and 20, greedy validation at the end."""
    out, files = small_task
    run = tmp_path_factory.mktemp("cli2") / "run"
    val = run.parent / "val.jsonl"  # eight training prompts, answered greedily at the end
    val.write_text("".join(files["rl_train"].read_text().splitlines(keepends=True)[:8]))
    result = posttrain("train", *train_args(small_task, run, "trainer.n_gpus_per_node=2", "trainer.total_training_steps=20",
                                            "trainer.save_freq=10", f"data.val_files={val}",
                                            "trainer.test_freq=20", f"trainer.validation_data_dir={run / 'val'}"))
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_two_processes_learn_like_one(two_process_run):
    m = metrics(two_process_run)
    assert [x["step"] for x in m] == list(range(1, 21))  # rank 0 alone logs: one line per step
    scores = [x["critic/score/mean"] for x in m]
    # measured: 0.23 -> 0.31 in 2 processes; 0.21 -> 0.31 in one process with the same settings
    assert sum(scores[-4:]) / 4 > sum(scores[:4]) / 4 + 0.05, [round(s, 3) for s in scores]
    assert sorted(p.name for p in (two_process_run / "global_step_20" / "actor").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # one shard per rank


def test_resume_in_two_processes_continues_exactly(small_task, two_process_run, tmp_path):
    run = tmp_path / "resumed"
    result = posttrain("train", *train_args(small_task, run, "trainer.n_gpus_per_node=2", "trainer.total_training_steps=20",
                                            "trainer.resume_mode=resume_path",
                                            f"trainer.resume_from_path={two_process_run / 'global_step_10'}"))
    assert result.returncode == 0, result.stderr[-3000:]
    resumed, straight = metrics(run), metrics(two_process_run)
    assert [m["step"] for m in resumed] == list(range(11, 21))
    assert [strip(m) for m in resumed] == [strip(m) for m in straight[10:20]]


def test_two_process_checkpoint_loads_in_one_and_exports(small_task, two_process_run, tmp_path):
    run = tmp_path / "one"
    result = posttrain("train", *train_args(small_task, run, "trainer.total_training_steps=21",
                                            "trainer.resume_mode=resume_path",
                                            f"trainer.resume_from_path={two_process_run / 'global_step_20'}"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and [m["step"] for m in metrics(run)] == [21]

    exported = tmp_path / "hf"
    result = posttrain("export", str(two_process_run / "global_step_20"), str(exported))
    assert result.returncode == 0, result.stderr[-3000:]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported)
    tok = AutoTokenizer.from_pretrained(exported)
    samples = [json.loads(line) for line in (two_process_run / "val" / "20.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (two_process_run.parent / "val.jsonl").read_text().splitlines()]
    assert len(samples) == len(rows) == 8  # validation records come back in dataset order
    checked = 0
    for sample, row in zip(samples, rows):
        assert sample["ground_truth"] == row["reward_model"]["ground_truth"]
        prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                         tokenize=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            ids = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(ids[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
        assert text == sample["response"]
        checked += 1
    assert checked == 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sequence_parallel_training_in_two_processes_follows_one_process(small_task, tmp_path):
    """`posttrain train` with ulysses_sequence_parallel_size=2 on 2 processes (gradient checkpointing on, so each
    layer's all-to-alls also run in the recompute) trains 2 GRPO steps with the numbers of one process and saves a
    checkpoint."""
    args = ("trainer.total_training_steps=2", "actor_rollout_ref.model.enable_gradient_checkpointing=True")
    one, two = tmp_path / "one", tmp_path / "sp2"
    result = posttrain("train", *train_args(small_task, one, *args))
    assert result.returncode == 0, result.stderr[-3000:]
    result = posttrain("train", *train_args(small_task, two, *args, "trainer.n_gpus_per_node=2", "trainer.save_freq=2",
                                            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"))
    assert result.returncode == 0, result.stderr[-3000:]
    want, got = metrics(one), metrics(two)
    assert [m["step"] for m in got] == [1, 2]
    assert sorted(p.name for p in (two / "global_step_2" / "actor").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # FSDP shards over the data x sequence ranks: one shard per rank
    for w, g in zip(want, got):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl"):
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), (g["step"], key)


def test_two_nodes_by_torchrun(small_task, tmp_path):
    """Two launches of `torchrun --nnodes=2` (here both on 127.0.0.1) join one 2-process job."""
    run, port = tmp_path / "nodes", free_port()
    args = train_args(small_task, run, "trainer.nnodes=2", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2")
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two_nodes",
                               "-m", "posttrain.cli", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [err[-2000:] for _, err in outputs]
    assert [m["step"] for m in metrics(run)] == [1, 2]


def test_a_failing_rank_stops_every_rank_with_its_error(small_task, tmp_path):
    """A rank that fails mid-run with an error nothing contains (here a BaseException from the scorer, called in
    the training process) stops every rank; the launcher says which rank and why."""
    reward = tmp_path / "reward.py"
    reward.write_text("import os\n"
                      "class Broken(BaseException):\n"
                      "    pass\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if os.environ.get('RANK') == '1':\n"
                      "        raise Broken('reward module broken on this node')\n"
                      "    return 0.0\n")
    result = posttrain("train", *train_args(small_task, tmp_path / "fail", "trainer.n_gpus_per_node=2",
                                            "trainer.total_training_steps=2", f"custom_reward_function.path={reward}",
                                            "reward_model.num_workers=0"))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error: rank 1 failed" in result.stderr and "reward module broken on this node" in result.stderr

def test_hf_export_in_two_processes_holds_no_rank(tiny_model_dir, tmp_path):
    """checkpoint.save_contents with hf_model in 2 processes: rank 0 writes each checkpoint's Hugging Face folder
    beside the training, without a collective, and the run ends with every folder written. (Before, rank 0 read the
    checkpoint back with a collective that the other rank, waiting at a barrier, never joined: the run hung at its
    first save.)"""
    import signal

    from transformers import AutoModelForCausalLM

    from posttrain.data.synthetic import write_task

    data = write_task(tmp_path / "data", seed=0, operands=range(0, 10), held_out=0, dev=10)["rl_train"]
    run = tmp_path / "run"
    argv = ["train", "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=32",
            "data.max_response_length=6", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data}",
            "trainer.total_training_steps=2", f"trainer.default_local_dir={run}",
            "trainer.logger=['jsonl']", "trainer.val_before_train=False", "trainer.save_freq=1",
            "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.checkpoint.save_contents=['model','optimizer','extra','hf_model']"]
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers end with their launcher
        proc.communicate()
        pytest.fail("the run hung")
    assert proc.returncode == 0, err[-3000:]
    for step in (1, 2):
        AutoModelForCausalLM.from_pretrained(run / f"global_step_{step}" / "actor" / "huggingface")
