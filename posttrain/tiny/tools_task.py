"""The tool task's offline pipeline: data and tiny model (`prepare_tools_task`), the SFT warm start (`tools_sft`),
and `posttrain demo --task tools` (`run_tools_demo`: GRPO on episodes with the calculator after the warm start)."""

from __future__ import annotations

import json
import re
from pathlib import Path

TOOL_FILE = Path(__file__).with_name("calculator_tool.py")  # multi_turn.function_tool_path of the task
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def prepare_tools_task(out_dir: str | Path, *, seed: int = 0, hidden_size: int = 128, num_layers: int = 2,
                       **task) -> dict[str, Path]:
    """The task's files (data/synthetic_tools.write_task; `task` passes on its sizes) and a tiny model with the tool
    chat template (`model`), under `out_dir`."""
    from ..data.synthetic_tools import tokenizer_corpus, write_task
    from ..models.tiny import build_tiny_model

    out = Path(out_dir)
    paths = write_task(out / "data", seed=seed, **task)
    paths["model"] = build_tiny_model(out / "tiny_init", tokenizer_corpus(seed), seed=seed, hidden_size=hidden_size,
                                      num_layers=num_layers, intermediate_size=3 * hidden_size, tools=True)
    return paths


def tools_sft(paths: dict[str, Path], out_dir: str | Path, *, seed: int = 0, epochs: float = 20.0, lr: float = 3e-3,
              batch_size: int = 32, patience: int = 0, dtype: str = "fp32", max_length: int = 128,
              quiet: bool = True) -> dict:
    """SFT of `paths["model"]` on the mixed demonstrations into `out_dir`, the best dev-loss checkpoint kept. In fp32
    by default, as the task's RL runs: in bf16 the seeded warm start lands where the CPU's bf16 kernels round it (the
    same 30 epochs scored 0.09 held-out on an Intel Xeon with AMX, 0.26-0.29 on an AMD EPYC with AVX512-BF16; fp32
    0.30 on the Xeon)."""
    from ..trainer.sft import SFTArgs, run_sft

    return run_sft(SFTArgs(model_path=str(paths["model"]), train_files=[str(paths["sft_train"])],
                           val_files=[str(paths["sft_dev"])], output_dir=str(out_dir), epochs=epochs, lr=lr,
                           batch_size=batch_size, max_length=max_length, eval_every=100, patience=patience, seed=seed,
                           dtype=dtype, quiet=quiet))


def parse_call(text: str) -> str | None:
    """The calculator expression of the first well-formed hermes call in `text`, else None."""
    match = _CALL.search(text)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") != "calculator" or not isinstance(call.get("arguments"), dict):
        return None
    expression = call["arguments"].get("expression")
    return expression if isinstance(expression, str) else None


def _value(expression: str, calculate) -> str | None:
    try:
        return calculate(expression)
    except ValueError:
        return None


TOOLS_RL_OVERRIDES = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=32", "data.max_prompt_length=64", "data.max_response_length=96",
    "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.optim.lr=1e-4",
    "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32",  # the same numbers on every CPU
    "actor_rollout_ref.rollout.multi_turn.enable=True", f"actor_rollout_ref.rollout.multi_turn.function_tool_path={TOOL_FILE}",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    "trainer.test_freq=10", "trainer.val_before_train=True", "trainer.resume_mode=disable",
    "trainer.overwrite_run_dir=True", "trainer.logger=['console']",
]


def program_overrides(program: str) -> list[str]:
    """The tool task played by an agent program (`module:function`, `file.py:function` or a command) over the
    OpenAI API instead of the episode loop: every sample of a step runs at once, so the server batches them."""
    return [f"actor_rollout_ref.rollout.agent.program={program}", "actor_rollout_ref.rollout.agent.num_workers=256"]


def environment_overrides(environment: str, test_file: str | Path) -> list[str]:
    """The tool task played by a verifiers environment (`data.environment`, e.g. examples/verifiers_envs/
    calculator_taskset.py) over the OpenAI API: its tasks are the prompts, its last ones (as many as `test_file`'s
    problems) held out, and those must be `test_file`'s problems (the taskset drew them for the same seed and
    sizes), or the held-out accuracy would not be the task's."""
    from ..agents.verifiers_env import environment_rows
    from ..errors import ConfigError

    test = [json.loads(line)["prompt"] for line in Path(test_file).read_text().splitlines()]
    _, held_out = environment_rows(environment, val_size=len(test))
    if [row["prompt"] for row in held_out] != test:
        raise ConfigError(f"data.environment={environment}: its last {len(test)} tasks are not the tool task's "
                          f"held-out problems ({test_file}); build the taskset for the same seed and sizes")
    return [f"data.environment={environment}", f"data.val_max_samples={len(test)}",
            "actor_rollout_ref.rollout.agent.num_workers=256"]


def run_tools_demo(out_dir: str | Path = "runs/demo_tools", *, seed: int = 0, rl_steps: int = 40,
                   sft_epochs: float = 30.0, extra_overrides: list[str] = (), quiet: bool = False,
                   program: str | None = None, environment: str | None = None) -> dict:
    """`posttrain demo --task tools`: the calculator task's SFT warm start, then GRPO on multi-turn episodes with the
    calculator; held-out greedy accuracy (and the share of first turns that call the tool right) before and after.
    `program`: the episodes are played by that agent program (examples/agent_programs/calculator_agent.py:run) over
    an OpenAI-compatible server on the policy, and rewarded by it. `environment`: the prompts are that verifiers
    taskset's tasks (examples/verifiers_envs/calculator_taskset.py), played and scored by it over the server."""
    import time

    from ..agents.episode_log import read_episodes
    from ..config import load_config
    from ..trainer.rl import RLTrainer

    out, t0 = Path(out_dir), time.time()
    say = (lambda *a: None) if quiet else print
    paths = prepare_tools_task(out, seed=seed)
    say(f"[demo tools] task and tiny model ready ({time.time() - t0:.0f}s); SFT on mixed demonstrations")
    tools_sft(paths, out / "sft", seed=seed, epochs=sft_epochs, quiet=quiet)
    t_sft = time.time() - t0
    say(f"[demo tools] SFT done ({t_sft:.0f}s); GRPO on episodes with the calculator"
        + (f", played by {program or environment}" if program or environment else ""))
    data = (environment_overrides(environment, paths["test"]) if environment else
            [f"data.train_files={paths['rl_train']}", f"data.val_files={paths['test']}"])
    cfg = load_config(None, TOOLS_RL_OVERRIDES + data + [
        f"actor_rollout_ref.model.path={out / 'sft'}", f"trainer.total_training_steps={rl_steps}",
        f"trainer.seed={seed}", f"data.seed={seed}", f"trainer.default_local_dir={out / 'rl'}",
        f"trainer.save_freq={rl_steps}", *(program_overrides(program) if program else []), *extra_overrides])
    final = RLTrainer(cfg).fit()
    history = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    key = next(k for k in history[0] if k.startswith("val-core/"))
    calls = {step: correct_call_share(read_episodes(out / "rl", step)[1]) for step in (0, rl_steps)}
    result = {"sft_accuracy": history[0][key], "rl_accuracy": final[key], "gain": final[key] - history[0][key],
              "sft_correct_call": calls[0], "rl_correct_call": calls[rl_steps], "rl_steps": rl_steps,
              "sft_seconds": round(t_sft, 1), "total_seconds": round(time.time() - t0, 1)}
    (out / "demo_result.json").write_text(json.dumps(result, indent=1))
    say(f"[demo tools] held-out greedy accuracy: SFT {result['sft_accuracy']:.1%} -> GRPO {result['rl_accuracy']:.1%} "
        f"({result['gain']:+.1%}); right first call {result['sft_correct_call']:.1%} -> {result['rl_correct_call']:.1%}; "
        f"{result['total_seconds']:.0f}s")
    return result


def correct_call_share(records: list[dict]) -> float:
    """The share of logged episodes (posttrain episodes' records) whose first assistant turn calls the calculator
    with an expression whose value is the product the prompt asks for (`a*b=`; the ground truth of the task's rows,
    and of a verifiers environment's, whose ground truth is a task key)."""
    from ..data.calculator import calculate

    right = 0
    for record in records:
        problem = next((m["content"] for m in record["messages"] if m["role"] == "user"), "")
        first = next((m["content"] for m in record["messages"] if m["role"] == "assistant"), "")
        expression, truth = parse_call(first), _value(problem.rstrip("="), calculate)
        right += None not in (expression, truth) and _value(expression, calculate) == truth
    return right / max(len(records), 1)
