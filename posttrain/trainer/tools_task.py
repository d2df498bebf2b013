"""The tool task's offline pipeline up to RL: data and tiny model (`prepare_tools_task`), the SFT warm start
(`tools_sft`), and what the policy does with the tool after it (`measure_tool_use`).

`measure_tool_use` plays short episodes by re-rendering the conversation each turn: a measuring stick for the
SFT model (its tool calls and final answers), not the training loop, which keeps sampled tokens exactly.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
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
              batch_size: int = 32, patience: int = 0, quiet: bool = True) -> dict:
    """SFT of `paths["model"]` on the mixed demonstrations into `out_dir`, the best dev-loss checkpoint kept."""
    from .sft import SFTArgs, run_sft

    return run_sft(SFTArgs(model_path=str(paths["model"]), train_files=[str(paths["sft_train"])],
                           val_files=[str(paths["sft_dev"])], output_dir=str(out_dir), epochs=epochs, lr=lr,
                           batch_size=batch_size, max_length=128, eval_every=100, patience=patience, seed=seed,
                           quiet=quiet))


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


def measure_tool_use(model_dir: str | Path, data_file: str | Path, *, max_turns: int = 3, limit: int | None = None,
                    max_new_tokens: int = 48, temperature: float = 0.0, seed: int = 0) -> dict:
    """Greedy (or, with `temperature`, sampled) episodes on `data_file`'s prompts: the share whose first turn calls the calculator at all
    (`valid_call`), with the right expression (`correct_call`), not at all (`no_call`: no <tool_call> in it), and the
    share whose final
    answer is right (`accuracy`, by the task's scorer), overall and per problem kind."""
    import torch

    from ..data.batch import Batch
    from ..data.calculator import CalculatorError, calculate
    from ..data.dataset import PromptItem, collate_prompts, read_rows
    from ..data.synthetic_tools import tool_schemas
    from ..models.load import load_causal_lm, load_tokenizer
    from ..models.policy import PolicyModel
    from ..reward.tool_answer import score_integer_answer
    from ..rollout.base import SamplingParams
    from ..rollout.engine import DecodeEngine

    rows = read_rows(data_file)[:limit]
    tok = load_tokenizer(str(model_dir))
    engine = DecodeEngine(PolicyModel(load_causal_lm(str(model_dir))), tok, device=torch.device("cpu"),
                          dtype=torch.float32, cuda_graphs=False)
    tools = tool_schemas()
    sampling = SamplingParams(n=1, do_sample=temperature > 0, temperature=temperature or 1.0,
                              max_new_tokens=max_new_tokens)
    torch.manual_seed(seed)
    talks = [list(r["prompt"]) for r in rows]
    first: list[str | None] = [None] * len(rows)  # the first turn's expression
    called = [False] * len(rows)  # the first turn opens a tool call, well-formed or not
    live = list(range(len(rows)))
    for turn in range(max_turns):
        if not live:
            break
        items = [PromptItem(tok.apply_chat_template(talks[i], tools=tools, add_generation_prompt=True,
                                                    tokenize=False), "", "") for i in live]
        for item in items:
            item.prompt_ids = tok(item.prompt_ids, add_special_tokens=False)["input_ids"]
        prompts, mask = collate_prompts(items, engine.pad_id)
        out = engine.generate(Batch({"prompts": prompts, "prompt_mask": mask}, {"uid": live}), sampling)
        texts = tok.batch_decode(out["responses"], skip_special_tokens=True)
        still = []
        for i, text in zip(live, texts):
            talks[i].append({"role": "assistant", "content": text})
            expression = parse_call(text)
            if turn == 0:
                first[i], called[i] = expression, "<tool_call>" in text
            if expression is None:
                continue
            try:
                result = calculate(expression)
            except CalculatorError as e:
                result = f"error: {e}"
            talks[i].append({"role": "tool", "name": "calculator", "content": result})
            still.append(i)
        live = still
    counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row, expression, call, talk in zip(rows, first, called, talks):
        truth = row["reward_model"]["ground_truth"]
        right = expression is not None and _value(expression, calculate) == truth
        for key in ("all", row["extra_info"].get("kind", "all")):
            c = counts[key]
            c["n"] += 1
            c["valid_call"] += expression is not None
            c["correct_call"] += right
            c["no_call"] += not call
            c["accuracy"] += score_integer_answer("", truth, {"messages": talk})
    return {kind: {k: (v / c["n"] if k != "n" else int(v)) for k, v in c.items()} for kind, c in counts.items()}


def _value(expression: str, calculate) -> str | None:
    try:
        return calculate(expression)
    except ValueError:
        return None
