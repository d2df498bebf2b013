"""`posttrain eval MODEL --data FILE...`: sample `n` answers per prompt of a dataset in the RL data layout, score
them with the same rule scorers as training, and report mean@n, maj@n, best@n and pass@k per data_source — under
the metric names validation logs during training (`val-core/<source>/acc/mean@n`, `val-aux/...`), so the numbers
compare directly. MODEL is a checkpoint (RUN_DIR/global_step_N), a run folder (its latest checkpoint), an
exported or any Hugging Face folder, or a hub id. Every sample goes to a JSONL file.

Agents: a sample is an episode (agents/rollout.py, as training's multi-turn rollouts) when the run that saved the
checkpoint trained on episodes (its RUN_DIR/config.yaml has `multi_turn.enable`), or with `--multi-turn` / a tool
file flag; the flags win over the run's settings. The episode is scored as in training (the whole response, the
environment's reward added), its conversation goes to the samples file, and `val-agent/*` metrics join the others."""

from __future__ import annotations

from collections import Counter

import dataclasses
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config.loader import ConfigError


@dataclass
class EvalArgs:
    model: str
    data_files: list
    output: str = "eval_samples.jsonl"  # the samples; the metrics go beside it as <stem>.metrics.json
    n: int = 1
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 512
    max_prompt_length: int = 1024
    batch_size: int = 32  # prompts per generate call
    max_samples: int = -1  # the first rows of the data only (-1: all)
    prompt_key: str = "prompt"
    reward_fn: str | None = None  # a custom scorer file (same signature as custom_reward_function.path)
    reward_fn_name: str = "compute_score"
    num_workers: int | None = None  # scorer processes; None: as training picks; 0: score in this process
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    missing_chat_template: str = "error"
    quiet: bool = False
    # episodes (docs/agents.md); None: as the run that saved the checkpoint did (its config.yaml), else off
    multi_turn: bool | None = None
    # each of these implies multi_turn (unless it is False)
    tool_config_path: str | None = None  # a verl tool YAML (multi_turn.tool_config_path)
    function_tool_path: str | None = None  # a file of @function_tool functions (multi_turn.function_tool_path)
    agent: str | None = None  # the environment of rows without agent_name (rollout.agent.default_agent_loop)
    max_assistant_turns: int | None = None
    # agent programs (docs/agents.md): each sample is a run of `program` against a server over the model, as in
    # training (rollout.agent.program); `environment` (data.environment) takes the place of data_files: its last
    # `max_samples` tasks (those training holds out with data.val_max_samples), played by its own program
    program: str | None = None
    environment: str | None = None
    program_timeout_s: float | None = None  # None: as training's default (rollout.agent.program_timeout_s)


def check_eval_args(a: EvalArgs) -> None:
    """Every bad flag at once, named as typed on the command line, before a model loads."""
    problems = []
    for flag, value, least in (("--n", a.n, 1), ("--max-new-tokens", a.max_new_tokens, 1),
                               ("--max-prompt-length", a.max_prompt_length, 1), ("--batch-size", a.batch_size, 1)):
        if not isinstance(value, int) or value < least:
            problems.append(f"{flag}={value!r} must be a whole number >= {least}")
    if not (isinstance(a.temperature, (int, float)) and math.isfinite(a.temperature) and a.temperature >= 0):
        problems.append(f"--temperature={a.temperature!r} must be >= 0 (0: greedy)")
    elif a.n > 1 and a.temperature == 0:
        problems.append(f"--n {a.n} with --temperature 0 (greedy) gives the same answer {a.n} times; "
                        "set --temperature (e.g. 1.0) to sample")
    if not 0 < a.top_p <= 1:
        problems.append(f"--top-p={a.top_p!r} must lie in (0, 1]")
    if a.num_workers is not None and a.num_workers < 0:
        problems.append(f"--num-workers={a.num_workers!r} must be >= 0")
    problems += _program_problems(a)
    if not a.data_files and a.environment is None:
        problems.append("--data names no file (or give --environment)")
    for f in a.data_files:
        if not Path(f).is_file():
            problems.append(f"--data: '{f}' does not exist (or is not a file)")
    if a.reward_fn and not Path(a.reward_fn).is_file():
        problems.append(f"--reward-fn: '{a.reward_fn}' does not exist (or is not a file)")
    for flag, path in (("--tool-config", a.tool_config_path), ("--function-tools", a.function_tool_path)):
        if path and not Path(path).expanduser().is_file():
            problems.append(f"{flag}: '{path}' does not exist (or is not a file)")
    if a.agent is not None:
        from ..agents.environment import ENVIRONMENTS

        if a.agent not in ENVIRONMENTS:
            problems.append(f"--agent={a.agent!r}: no such environment "
                            f"(registered: {', '.join(sorted(ENVIRONMENTS))})")
    turns = a.max_assistant_turns
    if turns is not None and (not isinstance(turns, int) or turns < 1):
        problems.append(f"--max-assistant-turns={a.max_assistant_turns!r} must be a whole number >= 1")
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"{len(problems)} problems; nothing was started:\n" + "\n".join(f"  - {p}" for p in problems))


def _program_problems(a: EvalArgs) -> list[str]:
    """--program / --environment: one of them, with data of their own kind, and none of the loop's flags (a program
    runs its tools itself)."""
    from ..tools.targets import is_callable_target, load_callable

    if a.program is None and a.environment is None:
        return []
    problems = []
    if a.program is not None and a.environment is not None:
        problems.append("--program with --environment: an environment plays its tasks with its own program; "
                        "give one of them")
    loop = [flag for flag, value in (("--multi-turn", a.multi_turn), ("--tool-config", a.tool_config_path),
                                     ("--function-tools", a.function_tool_path), ("--agent", a.agent),
                                     ("--max-assistant-turns", a.max_assistant_turns)) if value]
    if loop:
        problems.append(f"{', '.join(loop)} with {'--program' if a.program is not None else '--environment'}: "
                        "these set up posttrain's episode loop; an agent program runs its own turns and tools")
    if a.program is not None and not a.program.strip():
        problems.append("--program is empty: name a function (module:function or file.py:function) or a command")
    elif a.program is not None and is_callable_target(a.program):
        try:
            load_callable(a.program)
        except ValueError as e:
            problems.append(f"--program: {e}")
    if a.environment is not None:
        if not a.environment.startswith("verifiers:") or a.environment == "verifiers:":
            problems.append(f"--environment={a.environment!r}: expected 'verifiers:<module or taskset id>'")
        if a.data_files:
            problems.append("--environment with --data: the environment's tasks are the data; give one of them")
        if a.max_samples < 1:
            problems.append("--environment needs --max-samples N >= 1: its last N tasks are evaluated (those "
                            "training holds out with data.val_max_samples=N)")
    if a.program_timeout_s is not None and not (math.isfinite(a.program_timeout_s) and a.program_timeout_s > 0):
        problems.append(f"--program-timeout={a.program_timeout_s!r} must be positive")
    return problems


def program_runner(args: EvalArgs, engine, tokenizer):
    """The ProgramRunner of --program / --environment (training's runner, on the eval rows), else None."""
    from ..agents.program import ProgramRunner
    from ..agents.settings import AgentSettings
    from ..config.normalise import ENVIRONMENT_PROGRAM

    program = ENVIRONMENT_PROGRAM if args.environment is not None else args.program
    if program is None:
        return None
    timeout = {} if args.program_timeout_s is None else {"program_timeout_s": args.program_timeout_s}
    return ProgramRunner(engine, tokenizer, AgentSettings(program=program, **timeout))


def environment_files(args: EvalArgs, folder: Path) -> list[str]:
    """--environment's held-out tasks as a JSONL file in `folder`: its last --max-samples tasks."""
    from ..agents.verifiers_env import environment_rows

    _, rows = environment_rows(args.environment, val_size=args.max_samples)
    path = folder / "tasks.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [str(path)]


def load_model_for_eval(source: str, *, trust_remote_code: bool = False):
    """(causal LM on the CPU, tokenizer folder, what was loaded) for a checkpoint, a run folder, an HF folder or a
    hub id."""
    from ..models.load import load_causal_lm
    from .checkpoint import latest_checkpoint
    from .export import load_checkpoint_model

    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        step_dir = path if (path / "actor" / "hf").is_dir() else latest_checkpoint(path)
        if step_dir is None:
            if (path / "metrics.jsonl").is_file():
                raise ConfigError(f"{source} is a run folder without a checkpoint (it ran with trainer.save_freq=-1); "
                                  "set trainer.save_freq to keep one")
            raise ConfigError(f"{source} is neither a Hugging Face model folder (config.json), a checkpoint "
                              "(RUN_DIR/global_step_N) nor a run folder with one")
        model, hf_dir = load_checkpoint_model(step_dir, role="actor", runnable=True)
        return model, str(hf_dir), str(step_dir)
    model = load_causal_lm(source, trust_remote_code=trust_remote_code, key="MODEL")
    return model, source, source


def agent_settings_for(args: EvalArgs, loaded: str):
    """The episodes' settings (AgentSettings), or None for single responses: the settings of the run that saved
    `loaded` (a checkpoint: its RUN_DIR/config.yaml) when it trained on episodes, with the flags over them."""
    from ..agents.settings import AgentSettings

    run = _run_agent_settings(Path(loaded))
    flags = {"tool_config_path": args.tool_config_path, "function_tool_path": args.function_tool_path,
             "default_agent_loop": args.agent, "max_assistant_turns": args.max_assistant_turns}
    flags = {k: v for k, v in flags.items() if v is not None}
    wanted = args.multi_turn if args.multi_turn is not None else run is not None or bool(flags)
    if not wanted:
        return None
    return dataclasses.replace(run or AgentSettings(), **flags)


def _run_agent_settings(step_dir: Path):
    """AgentSettings of the run a checkpoint belongs to, when that run trained on episodes; else None."""
    import yaml
    from omegaconf import OmegaConf

    from ..agents.settings import AgentSettings

    config = step_dir.parent / "config.yaml"
    if not (step_dir / "actor").is_dir() or not config.is_file():
        return None
    cfg = OmegaConf.create(yaml.safe_load(config.read_text()))
    try:
        enabled = cfg.actor_rollout_ref.rollout.multi_turn.enable
    except Exception:  # a config of an older run, without the multi-turn keys
        return None
    return AgentSettings.from_config(cfg) if enabled else None


def run_eval(args: EvalArgs) -> dict[str, float]:
    """Generate (or run episodes), score, write the samples and the metrics; returns the metrics."""
    from ..agents.environment import ENVIRONMENTS
    from ..agents.loop import EpisodeRunner
    from ..agents.metrics import episode_metrics
    from ..agents.rollout import run_episodes
    from ..agents.tool_agent import toolbox_for
    from ..data.dataset import RLDataset
    from ..tools import ToolLoadError
    from ..models.load import compute_dtype, load_tokenizer, pick_device
    from ..models.policy import PolicyModel
    from ..models.vision import load_vision_processor
    from ..progress import ProgressBar
    from ..reward.manager import RewardManager, auto_workers
    from ..reward.registry import FileFunction
    from ..rollout.base import SamplingParams
    from ..rollout.engine import DecodeEngine
    from .metrics import validation_metrics

    check_eval_args(args)
    device = pick_device(args.device)
    lm, tok_dir, loaded = load_model_for_eval(args.model, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(tok_dir, args.trust_remote_code, key="MODEL")
    processor = load_vision_processor(tok_dir, tokenizer, trust_remote_code=args.trust_remote_code, key="MODEL")
    agents = agent_settings_for(args, loaded) if args.program is None and args.environment is None else None
    episode_data = {}
    if agents is not None:  # prompts rendered with the tools the episodes offer
        try:
            episode_data = {"tools": toolbox_for(agents).schemas() or None, "agent_names": ENVIRONMENTS}
        except ToolLoadError as e:  # a tool file that does not load: named, not a traceback
            raise ConfigError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix="posttrain-environment-") as folder:  # read whole while it exists
        files = environment_files(args, Path(folder)) if args.environment is not None else args.data_files
        data = RLDataset(files, tokenizer, prompt_key=args.prompt_key, max_prompt_length=args.max_prompt_length,
                         max_samples=args.max_samples, missing_chat_template=args.missing_chat_template,
                         processor=processor, **episode_data)
    scorer = FileFunction(args.reward_fn, args.reward_fn_name) if args.reward_fn else None
    workers = auto_workers() if args.num_workers is None else args.num_workers
    reward = RewardManager(tokenizer, compute_score=scorer, num_workers=workers)
    if args.environment is None:  # an environment's program scores its episodes
        reward.check_data_sources(it.data_source for it in data.items)
    engine = DecodeEngine(PolicyModel(lm.to(device)), tokenizer, device=device, dtype=compute_dtype(args.dtype, device))
    sampling = SamplingParams(n=args.n, do_sample=args.temperature > 0, temperature=args.temperature or 1.0,
                              top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens)
    runner = EpisodeRunner(engine, tokenizer, agents) if agents is not None else program_runner(args, engine, tokenizer)
    rows, episodes = [], []
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with ProgressBar("eval", len(data), unit="prompts", enabled=not args.quiet, stderr=True) as bar:
            for start in range(0, len(data), args.batch_size):
                items = [data[i] for i in range(start, min(start + args.batch_size, len(data)))]
                torch.manual_seed(args.seed * 1_000_003 + start)
                prompts = _prompt_batch(items, engine.pad_id, start)
                batch = (run_episodes(runner, prompts, sampling) if runner is not None
                         else engine.generate(prompts, sampling))
                _, extras = reward(batch)
                rows += _sample_rows(batch.meta, extras, args.n)
                episodes += batch.meta.get("episode", [])
                bar.advance(len(items))
    finally:
        reward.close()
    rows += _failed_runs(data, rows, args.n)
    with out.open("w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    metrics = validation_metrics([r["data_source"] for r in rows], [r["index"] for r in rows],
                                 [r["score"] for r in rows], [r["answer"] for r in rows])
    if episodes:  # named as training's validation names them
        metrics |= {f"val-{k}": v for k, v in episode_metrics(episodes).items()}
    if runner is not None and hasattr(runner, "take_metrics"):  # agent programs: runs, failures, samples
        metrics |= {f"val-{k}": v for k, v in runner.take_metrics().items()}
    summary = {"model": loaded, "data": [str(p) for p in args.data_files], "prompts": len(data), "n": args.n,
               "temperature": args.temperature, "samples": str(out), "metrics": metrics}
    metrics_path(out).write_text(json.dumps(summary, indent=1))
    return metrics


def metrics_path(samples: Path) -> Path:
    return samples.with_name(samples.stem + ".metrics.json")


def _prompt_batch(items, pad_id: int, first: int):
    from ..data.batch import Batch
    from ..data.dataset import collate_prompts
    from ..models.vision import MM_KEY

    prompts, mask = collate_prompts(items, pad_id)
    images = {MM_KEY: [it.images for it in items]} if any(it.images is not None for it in items) else {}
    return Batch({"prompts": prompts, "prompt_mask": mask},
                 {"uid": [first + i for i in range(len(items))], "data_source": [it.data_source for it in items],
                  "ground_truth": [it.ground_truth for it in items], "extra_info": [it.extra_info for it in items],
                  "raw_prompt": [it.raw_prompt for it in items],
                  "agent_name": [getattr(it, "agent_name", None) for it in items], **images})


def _answer(data_source: str, text: str):
    """The extracted final answer (maj@n votes on it); None where the source's scorer has no extractor."""
    from ..reward.registry import extract_answer_for

    try:
        return extract_answer_for(data_source, text)
    except (KeyError, ValueError):
        return None


def _failed_runs(data, rows: list[dict], n: int) -> list[dict]:
    """A row for each of the `n` samples of a prompt that gave none (an agent program's run that failed): score 0,
    so failing runs count as wrong answers and every prompt weighs the same (`failed: true` marks them). Training
    drops such runs (the failure may be the harness's); an evaluation that dropped them would rate a program better
    the more often it fails."""
    got = Counter(r["index"] for r in rows)
    out = []
    for i in range(len(data)):
        it = data[i]
        out += [{"index": i, "sample": None, "data_source": it.data_source, "prompt": it.raw_prompt,
                 "ground_truth": str(it.ground_truth), "response": None, "answer": None, "score": 0.0, "acc": 0.0,
                 "failed": True}] * (n - got[i])
    return out


def _sample_rows(meta: dict, extras: dict, n: int) -> list[dict]:
    rows = []
    for i, (uid, ds, chat, truth, text, score, acc) in enumerate(zip(
            meta["uid"], meta["data_source"], meta["raw_prompt"], meta["ground_truth"], extras["response_text"],
            extras["score"], extras["acc"])):
        rows.append({"index": uid, "sample": i % n, "data_source": ds, "prompt": chat, "ground_truth": str(truth),
                     "response": text, "answer": _answer(ds, text), "score": score, "acc": acc})
    for row, ep in zip(rows, meta.get("episode") or []):  # what the episode did, turn by turn
        row |= {"messages": ep.messages, "turns": ep.assistant_turns, "tool_calls": ep.tool_calls,
                "tool_errors": dict(ep.tool_errors), "env_reward": ep.env_reward, "truncated": ep.truncated}
    return rows


def results_table(metrics: dict[str, float]):
    """A rich Table: one row per data source, a column per metric (mean@n first, then maj@n, best@n, pass@k)."""
    from rich.table import Table

    per_source: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():  # val-core/<data source, may hold "/">/acc/mean@4
        if "/acc/" not in key:  # val-agent/*: printed apart
            continue
        source, name = key.split("/", 1)[1].rsplit("/acc/", 1)
        per_source.setdefault(source, {})[name] = value
    order = {"mean": 0, "maj": 1, "best": 2, "pass": 3}

    def rank(name: str):
        kind, k = name.split("@")
        return order.get(kind, 9), int(k)

    names = sorted({n for m in per_source.values() for n in m}, key=rank)
    table = Table(title="posttrain eval: accuracy per data source")
    table.add_column("data_source")
    for name in names:
        table.add_column(name, justify="right")
    for source, m in sorted(per_source.items()):
        table.add_row(source, *(f"{m[n]:.1%}" if n in m else "-" for n in names))
    return table
