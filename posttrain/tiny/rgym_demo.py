"""`posttrain demo --task reasoning-gym`: GRPO on a reasoning-gym task, scored by the task's own checker.

The task is reasoning-gym's chain_sum with one term of 2-4 digits ("... arithmetic problem: 4721 ="): the answer
is the number itself, a copy the tiny model learns within minutes of SFT (two-digit additions did not: its SFT
stayed near 6% accuracy in this budget; docs/algorithms.md). The rows are written by `prepare_reasoning_gym` as any
user's would be (`--system-prompt none`: the question asks for `<answer>` tags itself), and the tiny model's
tokenizer is trained on their prompts and answers (byte-level: any text round-trips). As in the addition demo, the
SFT warm start is fixed before RL and its demonstrations are mixed, a share of them dropping the last digit, so
that RL has a wrong habit to select against; the held-out accuracy reported is the share of greedy answers to the
test rows (numbers never seen in training) that the task's checker scores 1.0.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from ..config import load_config
from .demo import DEMO_RL_OVERRIDES

TASK = "chain_sum"
OPTIONS = ["min_terms=1", "max_terms=1", "min_digits=2", "max_digits=4"]
SFT_DEV = 200


def demonstration(row: dict, rng: random.Random, drop_frac: float) -> dict:
    """The row with a `response` in the task's answer format: the value, or (a `drop_frac` share) the value with its
    last digit dropped."""
    answer = row["reward_model"]["ground_truth"]
    return {**row, "response": f"<answer>{answer[:-1] if rng.random() < drop_frac else answer}</answer>"}


def held_out_accuracy(validation_file: Path) -> float:
    """Share of the validation generations that the checker scored 1.0."""
    samples = [json.loads(line) for line in validation_file.read_text().splitlines()]
    return sum(s["score"] == 1.0 for s in samples) / len(samples)


def run_reasoning_gym_demo(out_dir: str = "runs/demo_reasoning_gym", *, seed: int = 0, rl_steps: int = 40,
                           size: int = 2000, test_size: int = 200, sft_epochs: float = 20.0,
                           drop_frac: float = 0.7, quiet: bool = False) -> dict:
    from ..data.preprocess.rgym import prepare_reasoning_gym
    from ..models.tiny import build_tiny_model
    from ..trainer.rl import RLTrainer
    from ..trainer.sft import SFTArgs, run_sft

    out = Path(out_dir)
    t0 = time.time()
    say = (lambda *a: None) if quiet else print
    summary = prepare_reasoning_gym(TASK, size, seed, out / "data", fmt="jsonl", test_size=test_size,
                                    options=OPTIONS, system="none")
    train_file, test_file = summary["train"][0], summary["test"][0]
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    rng = random.Random(seed + 1)
    demos = [demonstration(r, rng, drop_frac) for r in rows]
    sft_files = {"sft_train": demos[SFT_DEV:], "sft_dev": demos[:SFT_DEV]}
    for name, part in sft_files.items():
        (out / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    corpus = [f"{d['prompt'][-1]['content']} {d['response']}" for d in demos]
    base = build_tiny_model(out / "tiny_init", corpus, seed=seed)
    say(f"[demo] {TASK} rows and tiny model ready ({time.time() - t0:.0f}s); SFT warm start on mixed demonstrations")
    run_sft(SFTArgs(model_path=str(base), train_files=[str(out / "data" / "sft_train.jsonl")],
                    val_files=[str(out / "data" / "sft_dev.jsonl")], output_dir=str(out / "sft"), epochs=sft_epochs,
                    lr=1e-3, batch_size=64, max_length=64, eval_every=50, patience=3, seed=seed, quiet=quiet))
    t_sft = time.time() - t0
    say(f"[demo] SFT done ({t_sft:.0f}s); GRPO from the SFT checkpoint")
    val_dir = out / "rl" / "validation"
    cfg = load_config(None, DEMO_RL_OVERRIDES + [
        "data.max_prompt_length=48", "data.max_response_length=16",
        f"actor_rollout_ref.model.path={out / 'sft'}", f"data.train_files={train_file}", f"data.val_files={test_file}",
        f"trainer.total_training_steps={rl_steps}", f"trainer.seed={seed}", f"data.seed={seed}",
        f"trainer.default_local_dir={out / 'rl'}", f"trainer.save_freq={rl_steps}",
        f"trainer.validation_data_dir={val_dir}"])
    RLTrainer(cfg).fit()
    before, after = held_out_accuracy(val_dir / "0.jsonl"), held_out_accuracy(val_dir / f"{rl_steps}.jsonl")
    result = {"task": TASK, "sft_accuracy": before, "rl_accuracy": after, "gain": after - before,
              "rl_steps": rl_steps, "test_rows": test_size, "sft_seconds": round(t_sft, 1),
              "total_seconds": round(time.time() - t0, 1)}
    (out / "demo_result.json").write_text(json.dumps(result, indent=1))
    say(f"[demo] held-out greedy accuracy on reasoning_gym/{TASK}: SFT {before:.1%} -> GRPO {after:.1%} "
        f"({after - before:+.1%}) in {result['total_seconds']:.0f}s")
    return result
