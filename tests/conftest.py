"""Shared fixtures: a tiny model built once per session (and, per module, a copy with larger random weights), the
shared data folder."""

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def pytest_configure(config):
    """Under pytest-xdist (pyproject's addopts run two workers) each worker computes on its share of the cores, so
    two workers do not fight over the same cores (what a test launches inherits the share)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers:
        import torch

        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(share)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_corpus(0, 500), hidden_size=64, num_layers=2,
                            num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from posttrain.models.load import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    """The tiny model with larger random weights: greedy text that depends on the prompt."""
    import torch

    from posttrain.models.load import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir)).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="session")
def small_task(tmp_path_factory):
    """One-digit addition, 8 demonstrations per problem of which 70% drop the carry, and a short SFT on it
    (about 25 s): greedy decoding then answers only the carry-free problems right, and RL has a choice to make."""
    from posttrain.data.synthetic import tokenizer_corpus, write_task
    from posttrain.models.tiny import build_tiny_model
    from posttrain.trainer.sft import SFTArgs, run_sft

    out = tmp_path_factory.mktemp("small_task")
    files = write_task(out / "data", seed=0, operands=range(0, 10), held_out=0, dev=10, copies=8)
    base = build_tiny_model(out / "init", tokenizer_corpus(0, 500), seed=0)
    run_sft(SFTArgs(model_path=str(base), train_files=[str(files["sft_train"])], output_dir=str(out / "sft"),
                    epochs=15, lr=2e-3, batch_size=32, max_length=64, eval_every=1000, seed=0, quiet=True))
    return out, files


FINISHED_RUN_LOGGERS = ["console", "jsonl", "tensorboard", "wandb", "mlflow"]


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, small_task):
    """A finished 3-step GRPO run from the small task's SFT model (about 10 s more): validated on 16 problems before
    training and after every step, the final checkpoint kept, logged to every sink — wandb offline, mlflow in a
    local file store. Returns a dict: run (the run folder), val (the validation file; its first 16 rows), console
    (what the console logger printed), mlflow_uri, project, experiment."""
    import contextlib
    import io

    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    task, files = small_task
    out = tmp_path_factory.mktemp("finished_run")
    run, uri = out / "run", f"file:{out / 'mlruns'}"
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "data.max_prompt_length=32",
        "data.max_response_length=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=3e-4", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.model.path={task / 'sft'}", f"data.train_files={files['rl_train']}",
        f"data.val_files={files['rl_train']}", "data.val_max_samples=16", "trainer.total_training_steps=3", "trainer.test_freq=1",
        "trainer.val_before_train=True", "trainer.save_freq=3", f"trainer.default_local_dir={run}",
        f"trainer.logger={FINISHED_RUN_LOGGERS}", "trainer.project_name=posttrain_tests",
        "trainer.experiment_name=finished", "reward_model.num_workers=0"])
    console = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(console):
        for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                           "MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
            mp.setenv(key, value)
        RLTrainer(cfg).fit()
    return {"run": run, "val": files["rl_train"], "console": console.getvalue(), "mlflow_uri": uri,
            "project": "posttrain_tests", "experiment": "finished"}


@pytest.fixture(scope="session")
def lively_model_dir(tmp_path_factory, tiny_model_dir):
    """The tiny model with larger random weights (normal, std 0.3), whose greedy turns do not repeat one token to
    the end of the budget: its greedy episodes have several turns."""
    import shutil

    import torch

    from posttrain.models.load import load_causal_lm

    out = tmp_path_factory.mktemp("lively") / "model"
    shutil.copytree(tiny_model_dir, out)
    model = load_causal_lm(str(tiny_model_dir))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return out
