"""`posttrain demo`: the whole pipeline offline in minutes — tiny model, SFT warm start, GRPO, held-out accuracy.

The SFT stage is fixed before RL starts; the accuracy gain reported is RL's alone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import load_config


DEMO_RL_OVERRIDES = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=32", "data.max_prompt_length=32", "data.max_response_length=8",
    "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.optim.lr=3e-5",
    "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "trainer.test_freq=10", "trainer.val_before_train=True", "trainer.resume_mode=disable",
    "trainer.overwrite_run_dir=True",  # the demo folder is its own: a second demo replaces the first
    "trainer.logger=['console']",
]


def demo_sft(out: Path, *, seed: int = 0, sft_epochs: float = 15.0, quiet: bool = False) -> dict[str, Path]:
    """The demo's task files (data.synthetic.write_task) and its SFT warm start in `out/sft`."""
    from ..data.synthetic import tokenizer_corpus, write_task
    from ..models.tiny import build_tiny_model
    from ..trainer.sft import SFTArgs, run_sft

    t0 = time.time()
    files = write_task(out / "data", seed=seed)
    base = build_tiny_model(out / "tiny_init", tokenizer_corpus(seed), seed=seed)
    if not quiet:
        print(f"[demo] tiny model and task ready ({time.time() - t0:.0f}s); SFT warm start on mixed demonstrations")
    run_sft(SFTArgs(model_path=str(base), train_files=[str(files["sft_train"])], val_files=[str(files["sft_dev"])],
                    output_dir=str(out / "sft"), epochs=sft_epochs, lr=1e-3, batch_size=64, max_length=64,
                    eval_every=50, patience=3, seed=seed, quiet=quiet))
    return files


def demo_rl_overrides(out: Path, files: dict[str, Path], *, seed: int = 0, rl_steps: int = 40) -> list[str]:
    """The demo's GRPO run from `out/sft` into `out/rl`."""
    return DEMO_RL_OVERRIDES + [
        f"actor_rollout_ref.model.path={out / 'sft'}", f"data.train_files={files['rl_train']}",
        f"data.val_files={files['test']}", f"trainer.total_training_steps={rl_steps}", f"trainer.seed={seed}",
        f"data.seed={seed}", f"trainer.default_local_dir={out / 'rl'}",
        f"trainer.save_freq={rl_steps}"]  # the final policy only: `posttrain eval runs/demo/rl` reads it


def run_demo(out_dir: str = "runs/demo", *, seed: int = 0, rl_steps: int = 40, sft_epochs: float = 15.0,
             extra_overrides: list[str] = (), quiet: bool = False) -> dict:
    from ..trainer.rl import RLTrainer

    out = Path(out_dir)
    t0 = time.time()
    say = (lambda *a: None) if quiet else print
    files = demo_sft(out, seed=seed, sft_epochs=sft_epochs, quiet=quiet)
    t_sft = time.time() - t0
    say(f"[demo] SFT done ({t_sft:.0f}s); GRPO from the SFT checkpoint")
    cfg = load_config(None, demo_rl_overrides(out, files, seed=seed, rl_steps=rl_steps) + list(extra_overrides))
    trainer = RLTrainer(cfg)
    final = trainer.fit()
    history = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    key = next(k for k in history[0] if k.startswith("val-core/"))
    before, after = history[0][key], final[key]
    result = {"sft_accuracy": before, "rl_accuracy": after, "gain": after - before, "rl_steps": rl_steps,
              "sft_seconds": round(t_sft, 1), "total_seconds": round(time.time() - t0, 1)}
    plot_history(history, key, out / "demo.png")
    (out / "demo_result.json").write_text(json.dumps(result, indent=1))
    say(f"[demo] held-out greedy accuracy: SFT {before:.1%} -> GRPO {after:.1%} ({after - before:+.1%}) "
        f"in {result['total_seconds']:.0f}s; plot: {out / 'demo.png'}")
    return result


def plot_history(history: list[dict], acc_key: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history if "critic/score/mean" in h]
    reward = [h["critic/score/mean"] for h in history if "critic/score/mean" in h]
    acc = [(h["step"], h[acc_key]) for h in history if acc_key in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, label="training reward (mean score)", alpha=0.7)
    ax.plot([a[0] for a in acc], [a[1] for a in acc], "o-", label="held-out greedy accuracy")
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("posttrain demo: GRPO after SFT")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
