"""Multi-turn episodes with slow tools: posttrain's episode loop against the plain turn-by-turn loop.

    python benchmarks/agent_loop.py [--models S,M] [--prompts 16] [--n 4] [--tool-ms 50] [--tool-turns 3]
                                    [--turn-tokens 32] [--budget 512] [--repeats 2] [--workdir DIR]

Workload: the random Qwen2 models S and M of grpo_step.py (same tokenizer; GSM8K questions after a system message
offering a tool, as a tool agent's prompt reads — about 300 tokens of prompt), fp32,
`--prompts` x `--n` episodes sampled at temperature 1. Every turn of the policy ends on an end-of-turn token; with
random weights the sampled tokens are near uniform, so the end-of-turn set is every `--turn-tokens`-th id (turns of
about that many tokens). A tool answers each turn after `--tool-ms` milliseconds with a short message, `--tool-turns`
times, then the episode ends (at least `--tool-turns` + 1 assistant turns per episode unless the budget ends it).

- `continuous`: posttrain's loop (agents/loop.py): an episode waiting for its tool leaves the decoding batch and
  resumes with only the tool's tokens computed; the others decode on.
- `turn_by_turn`: each turn re-prefills every live conversation, decodes them together until the slowest has ended
  its turn, then waits for every tool before the next turn.

Each (loop, model) runs in a fresh process, alternating A B A B (`--repeats`); reported: policy tokens per second
(tokens the policy sampled / wall time), episodes' mean turns and the ratio, beside the fp32 2048^2 matmul ceiling
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import build, matmul_ceiling  # noqa: E402


SYSTEM = """You are a math expert. You are given a question and you need to solve it step by step. Reasoning step by \
step before any tool call. You should use the `calc_gsm8k_reward` tool after step by step solving the question, \
before generate final answer at least once and refine your answer if necessary.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression of \
integers with + - * / and parentheses.", "parameters": {"type": "object", "properties": {"expression": \
{"type": "string", "description": "The expression, e.g. 1234*567."}}, "required": ["expression"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML \
tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""


def worker(args) -> None:
    import torch
    from transformers import AutoTokenizer

    from posttrain.agents.environment import Reset, Step
    from posttrain.agents.loop import EpisodeRunner
    from posttrain.agents.settings import AgentSettings
    from posttrain.agents.template import Template
    from posttrain.models.load import load_causal_lm
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.engine import DecodeEngine

    torch.manual_seed(0)
    path = Path(args.workdir) / args.model
    tok = AutoTokenizer.from_pretrained(path)
    model = load_causal_lm(str(path)).eval()
    rows = [json.loads(line) for line in (Path(args.workdir) / "train.jsonl").read_text().splitlines()]
    system = {"role": "system", "content": SYSTEM}  # a tool-agent prompt offers its tools, as Qwen's template does
    rows = [{"prompt": [system] + list(r["prompt"])} for r in rows[: args.prompts]]

    class SlowTool:
        def __init__(self):
            self.calls = 0

        def reset(self, row):
            return Reset(messages=row["prompt"])

        def step(self, episode):
            self.calls += 1
            time.sleep(args.tool_ms / 1000)
            if self.calls > args.tool_turns:
                return Step(done=True)
            return Step(messages=[{"role": "tool", "content": f"The result of call {self.calls} is 4217."}])

        def close(self):
            pass

    engine = DecodeEngine(model, tok, device=torch.device("cpu"), dtype=torch.float32)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    runner = EpisodeRunner(engine, tok, AgentSettings(tokenization_sanity_check_mode="disable", num_workers=64),
                           environments=lambda row: SlowTool())
    runner.template = Template(tok, {im_end})
    engine.eos_ids = {t for t in range(len(tok)) if t % args.turn_tokens == 0} | {im_end}
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.budget)
    runner.run(rows[:2], 1, SamplingParams(n=1, temperature=1.0, max_new_tokens=16),
               continuous=args.loop == "continuous")  # warm-up
    start = time.perf_counter()
    episodes = runner.run(rows, args.n, sampling, continuous=args.loop == "continuous")
    seconds = time.perf_counter() - start
    policy = sum(sum(e.mask) for e in episodes)
    print(json.dumps({"seconds": seconds, "policy_tokens": policy, "tokens_per_s": policy / seconds,
                      "turns": statistics.mean(e.assistant_turns for e in episodes),
                      "truncated": sum(e.truncated for e in episodes) / len(episodes)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="S,M")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tool-ms", type=float, default=50)
    p.add_argument("--tool-turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=32)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--loop", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    workdir = Path(args.workdir or Path(tempfile.gettempdir()) / "posttrain_bench")
    workdir.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    build(workdir, models)
    ceiling = matmul_ceiling("cpu")["fp32"]
    print(f"fp32 matmul ceiling: {ceiling:.0f} GFLOP/s")
    shared = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
              if k in ("prompts", "n", "tool_ms", "tool_turns", "turn_tokens", "budget")]
    for model in models:
        results: dict[str, list[dict]] = {"continuous": [], "turn_by_turn": []}
        for _ in range(args.repeats):
            for loop in results:
                out = subprocess.run([sys.executable, __file__, "--worker", f"--workdir={workdir}", f"--model={model}",
                                      f"--loop={loop}", *shared], capture_output=True, text=True, check=True)
                results[loop].append(json.loads(out.stdout.strip().splitlines()[-1]))
        row = {loop: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "turns": statistics.mean(r["turns"] for r in rs),
                      "truncated": statistics.mean(r["truncated"] for r in rs)} for loop, rs in results.items()}
        ratio = row["continuous"]["tokens_per_s"] / row["turn_by_turn"]["tokens_per_s"]
        print(f"model {model}: continuous {row['continuous']['tokens_per_s']:.0f} tok/s "
              f"(turns {row['continuous']['turns']:.1f}, truncated {row['continuous']['truncated']:.0%}), "
              f"turn-by-turn {row['turn_by_turn']['tokens_per_s']:.0f} tok/s "
              f"(turns {row['turn_by_turn']['turns']:.1f}, truncated {row['turn_by_turn']['truncated']:.0%}): "
              f"{ratio:.2f}x")


if __name__ == "__main__":
    main()
