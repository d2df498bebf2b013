"""`posttrain <command>`: the command line. Each command parses its arguments and hands off to one module."""

from __future__ import annotations

import argparse
import os
import sys


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="a YAML file, or the name of a shipped recipe (e.g. grpo)")
    p.add_argument("--config-path", help="Hydra-style: folder of --config-name (accepted so familiar scripts port)")
    p.add_argument("--config-name", help="Hydra-style: ppo_trainer or ppo_megatron_trainer (posttrain's defaults), "
                                         "or a YAML file in --config-path")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. algorithm.adv_estimator=grpo")


def _say(message: str) -> None:
    """Printed once per job: by rank 0 of a multi-process run (or the only process)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr)


def _load(args):
    """The config, checked for the process layout it will run in (torchrun's, when started by torchrun)."""
    from .config import ConfigError, config_warnings, hydra_config, load_config
    from .parallel import launch

    config_file, base = hydra_config(getattr(args, "config_path", None), getattr(args, "config_name", None))
    if config_file and args.config:
        raise ConfigError("give either --config or --config-path/--config-name, not both")

    def adopt(cfg):
        if launch.inside_launcher():
            for note in launch.adopt_launcher_world(cfg):
                _say(f"note: {note}")

    cfg = load_config(args.config or config_file, base + list(args.overrides), adjust=adopt)
    for note in config_warnings(cfg):
        _say(f"note: {note}")
    return cfg


def cmd_train(args) -> int:
    from .parallel import launch

    cfg = _load(args)
    if args.print_config:
        from .config import to_yaml

        print(to_yaml(cfg), end="")
        return 0
    if launch.inside_launcher():
        launch.die_with_launcher()
    if launch.requested_world(cfg) > 1 and not launch.inside_launcher():
        launch.check_launchable(cfg)
        return launch.launch_local(args.argv, launch.requested_world(cfg))
    from .trainer.preempt import start_up_window
    from .trainer.rl import run_rl

    start_up_window()
    if cfg.rollout.n_gpus_per_node > 0:
        from .trainer.async_rl import run_async

        run_async(cfg)
    else:
        run_rl(cfg)
    return 0


def _run_stops() -> tuple:
    """How a run can end short of its last step without a bug: preempted by a signal, a checkpoint that cannot be
    written, read or trusted. Each prints one message instead of a traceback."""
    from .parallel.safeload import UnsafeCheckpoint
    from .trainer.checkpoint import CheckpointWriteError
    from .trainer.preempt import Preempted
    from .trainer.recovery import CheckpointError
    from .trainer.tracking import MetricsWriteError
    from .watch import WatchStopped

    return Preempted, CheckpointWriteError, CheckpointError, UnsafeCheckpoint, MetricsWriteError, WatchStopped


def _stopped(e: BaseException) -> int:
    from .trainer.preempt import Preempted

    if isinstance(e, Preempted):
        _say(str(e))
        return e.exit_code
    print(f"error: {e}", file=sys.stderr)
    return 1


def cmd_export(args) -> int:
    from .trainer.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.output_dir, role=args.role, quiet=False)
    print(f"{args.role} of {args.checkpoint} -> {out}")
    return 0


def cmd_prepare(args) -> int:
    from .data.preprocess import prepare

    if args.dataset == "reasoning-gym":
        from .data.preprocess.rgym import prepare_reasoning_gym

        try:  # a task name, count or option that does not fit: one line, as argparse would say it
            if args.tasks is None or args.size is None or args.input is not None or args.tools:
                raise ValueError("usage: posttrain prepare reasoning-gym TASK[,TASK...] --size N [--seed S] "
                                 "(generated problems: no --input, no --tools)")
            summary = prepare_reasoning_gym(args.tasks, args.size, args.seed, args.output_dir, fmt=args.format,
                                            test_size=args.test_size, options=args.task_option,
                                            system=args.system_prompt, quiet=False)
        except (ValueError, ImportError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif args.tasks is not None:
        print(f"error: {args.dataset} takes no task names (they are for reasoning-gym), got {args.tasks!r}",
              file=sys.stderr)
        return 2
    else:
        summary = prepare(args.dataset, args.input, args.output_dir, fmt=args.format, tools=args.tools, quiet=False)
    for split, (path, rows) in summary.items():
        print(f"{split}: {rows} rows -> {path}" if path else f"{split}: the source has no {split} split")
    return 0


def cmd_demo(args) -> int:
    if args.task == "tools":
        from .tiny.tools_task import run_tools_demo

        run_tools_demo(args.output_dir or "runs/demo_tools", seed=args.seed, rl_steps=args.rl_steps,
                       program=args.program, environment=args.environment)
        return 0
    if args.task == "reasoning-gym":
        from .tiny.rgym_demo import run_reasoning_gym_demo

        run_reasoning_gym_demo(args.output_dir or "runs/demo_reasoning_gym", seed=args.seed, rl_steps=args.rl_steps)
        return 0
    from .tiny.demo import run_demo

    run_demo(args.output_dir or "runs/demo", seed=args.seed, rl_steps=args.rl_steps)
    return 0


def cmd_sft(args) -> int:
    from .trainer.sft import SFTArgs, run_sft

    run_sft(SFTArgs(model_path=args.model, train_files=args.train_files, val_files=args.val_files,
                    output_dir=args.output_dir, prompt_key=args.prompt_key, response_key=args.response_key,
                    epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, max_length=args.max_length,
                    eval_every=args.eval_every, patience=args.patience, seed=args.seed,
                    missing_chat_template=args.missing_chat_template,
                    max_nonfinite_updates_in_a_row=args.max_nonfinite_updates_in_a_row,
                    freeze_vision_tower=args.freeze_vision_tower))
    return 0


def _table_console():
    """A console for a result table: the terminal's width, or a wide one in a log (no cut-off columns)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def cmd_eval(args) -> int:
    from pathlib import Path

    from .trainer.evaluate import EvalArgs, metrics_path, results_table, run_eval

    metrics = run_eval(EvalArgs(
        model=args.model, data_files=args.data, output=args.output, n=args.n, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, max_new_tokens=args.max_new_tokens,
        max_prompt_length=args.max_prompt_length, batch_size=args.batch_size, max_samples=args.max_samples,
        prompt_key=args.prompt_key, reward_fn=args.reward_fn, reward_fn_name=args.reward_fn_name,
        num_workers=args.num_workers, seed=args.seed, device=args.device, dtype=args.dtype,
        trust_remote_code=args.trust_remote_code, missing_chat_template=args.missing_chat_template,
        multi_turn=args.multi_turn, tool_config_path=args.tool_config, function_tool_path=args.function_tools,
        agent=args.agent, max_assistant_turns=args.max_assistant_turns, program=args.program,
        environment=args.environment, program_timeout_s=args.program_timeout))
    _table_console().print(results_table(metrics))
    agent = {k: v for k, v in metrics.items() if k.startswith("val-agent/")}
    if agent:
        print("episodes: " + "  ".join(f"{k.removeprefix('val-agent/')}={v:.3g}" for k, v in agent.items()))
    print(f"samples: {args.output}\nmetrics: {metrics_path(Path(args.output))}")
    return 0


def cmd_plot(args) -> int:
    from pathlib import Path

    from .trainer.plots import plot_runs

    out = args.output_dir or (Path(args.run_dirs[0]) / "plots" if len(args.run_dirs) == 1 else Path("plots"))
    written = plot_runs(args.run_dirs, out)
    if not written:
        print(f"nothing to plot: no standard metric in {', '.join(args.run_dirs)}", file=sys.stderr)
        return 1
    print("\n".join(str(p) for p in written))
    return 0


def cmd_report(args) -> int:
    from .report import write_report

    try:
        path = write_report(args.run_dir, args.output)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def cmd_runs(args) -> int:
    from .trainer.runs import find_runs, runs_table

    runs = find_runs(args.folder)
    if not runs:
        print(f"no runs in {args.folder} (a run folder holds metrics.jsonl or sft_history.json)", file=sys.stderr)
        return 1
    _table_console().print(runs_table(args.folder, runs))
    return 0


def cmd_episodes(args) -> int:
    from .agents.episode_log import NoEpisodes
    from .trainer.episodes import show_episodes

    try:
        show_episodes(args.run_dir, step=args.step, index=args.index, limit=args.limit)
    except (NoEpisodes, IndexError) as e:
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 1
    return 0


def cmd_sandbox_server(args) -> int:
    from .reward.sandbox_server import serve

    serve(args.host, args.port, max_workers=args.max_workers, allow_unsandboxed=args.allow_unsandboxed)
    return 0


def cmd_serve(args) -> int:
    try:
        from .serve.limits import Limits
        from .serve.server import serve_engine
    except ImportError as e:  # the serve extra is not installed: checked before the model loads
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .models.load import compute_dtype, load_tokenizer, pick_device
    from .models.policy import PolicyModel
    from .rollout.registry import build_engine
    from .trainer.evaluate import load_model_for_eval

    device = pick_device(args.device)
    lm, tok_dir, _ = load_model_for_eval(args.model, trust_remote_code=args.trust_remote_code)
    tokenizer = load_tokenizer(tok_dir, args.trust_remote_code, key="MODEL")
    engine = build_engine("posttrain", PolicyModel(lm.to(device)), tokenizer, device=device,
                          dtype=compute_dtype(args.dtype, device))
    name = args.served_model_name or args.model
    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20), read_timeout_s=args.read_timeout_s,
                    max_connections=args.max_connections)
    serve_engine(engine, tokenizer, name, host=args.host, port=args.port, api_key=args.api_key,
                 max_running=args.max_running, max_waiting=args.max_waiting,
                 prefix_cache_tokens=args.prefix_cache_tokens,
                 request_timeout_s=args.request_timeout_s, limits=limits, shutdown_grace_s=args.shutdown_grace_s,
                 on_ready=lambda url: print(f"serving {name} at {url}", flush=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description="Reinforcement-learning post-training for LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="RL training (PPO, GRPO, ...) from config keys")
    _config_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="supervised fine-tuning on (prompt, response) rows or `messages` conversations; "
                       "loss on response / assistant tokens")
    p.add_argument("--model", required=True, help="local Hugging Face model directory or hub id (owner/name)")
    p.add_argument("--train-files", nargs="+", required=True)
    p.add_argument("--val-files", nargs="*", default=None, help="dev set: the lowest dev loss is kept")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--response-key", default="response")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--patience", type=int, default=0, help="stop after this many evaluations without improvement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--missing-chat-template", default="error", choices=["error", "join"],
                   help="a tokenizer without a chat template: stop, or join the message contents by newlines")
    p.add_argument("--max-nonfinite-updates-in-a-row", type=int, default=5,
                   help="updates with a NaN/inf loss or gradient are skipped; stop after this many in a row (0 = never)")
    p.add_argument("--freeze-vision-tower", action="store_true",
                   help="vision-language models: do not train the vision encoder")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("demo", help="offline demo: tiny model, SFT warm start, GRPO, held-out accuracy and a plot")
    p.add_argument("--task", choices=["add", "tools", "reasoning-gym"], default="add",
                   help="add: one-digit addition (single turn); tools: products of 3-4 digit numbers with a calculator "
                        "tool (multi-turn episodes); reasoning-gym: its chain_sum task with one term (the answer copies a "
                        "2-4 digit number), scored by the task's own checker (needs the reasoning-gym extra)")
    p.add_argument("--output-dir", default=None, help="default: runs/demo (add), runs/demo_tools (tools), "
                   "runs/demo_reasoning_gym (reasoning-gym)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rl-steps", type=int, default=40)
    played = p.add_mutually_exclusive_group()
    played.add_argument("--program", default=None,
                        help="--task tools: an agent program plays the episodes over the OpenAI API, e.g. "
                             "examples/agent_programs/calculator_agent.py:run (module:function, file.py:function or "
                             "a command line)")
    played.add_argument("--environment", default=None,
                        help="--task tools: a verifiers environment's tasks are the prompts, played and scored by it "
                             "over the OpenAI API: verifiers:examples/verifiers_envs/calculator_taskset.py:"
                             "CalculatorTaskset")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("export", help="a checkpoint as a plain Hugging Face folder (LoRA merged)")
    p.add_argument("checkpoint", help="RUN_DIR/global_step_N")
    p.add_argument("output_dir")
    p.add_argument("--role", default="actor", choices=["actor", "critic"])
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("prepare", help="turn GSM8K / MATH / Geometry3K original files (or the bundled code problems, "
                                       "or the synthetic visual counting task) into the RL data layout")
    p.add_argument("dataset", choices=["gsm8k", "math", "code", "geo3k", "visual-count", "reasoning-gym"])
    p.add_argument("tasks", nargs="?", default=None, help="reasoning-gym: its task names, TASK[,TASK...] (e.g. "
                   "chain_sum,gcd), each scored by the task's own checker (data_source reasoning_gym/<task>)")
    p.add_argument("--input", default=None, help="original file or folder (default: the shared data folder)")
    p.add_argument("--output-dir", default=None, help="where to write train/test files (default: data/<dataset>)")
    p.add_argument("--format", default="parquet", choices=["parquet", "jsonl", "both"])
    p.add_argument("--tools", action="store_true", help="gsm8k, math: the tool-agent layout (agent_name tool_agent, a "
                   "system prompt offering calc_gsm8k_reward / code_interpreter, extra_info.tools_kwargs with the "
                   "ground truth); default output data/<dataset>_tools")
    p.add_argument("--size", type=int, default=None, help="reasoning-gym: training rows per task (required)")
    p.add_argument("--seed", type=int, default=0, help="reasoning-gym: the generators' seed; the same command writes "
                   "the same files")
    p.add_argument("--test-size", type=int, default=None, help="reasoning-gym: test rows per task, none repeating a "
                   "training question (default: size // 10, at least 1)")
    p.add_argument("--task-option", action="append", default=[], metavar="TASK.KEY=VALUE", help="reasoning-gym: a "
                   "setting of a task's config, e.g. chain_sum.max_terms=2 (value read as JSON); repeatable")
    p.add_argument("--system-prompt", default="default", help="reasoning-gym: which of its system prompts the rows "
                   "carry (default, DeepSeekZero, simple, direct, chain_of_draft) or none (the question then asks "
                   "for <answer> tags itself); default output data/reasoning_gym/<tasks>")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("eval", help="accuracy of a model on a dataset: mean@n, maj@n, pass@k per data_source")
    p.add_argument("model", help="a checkpoint (RUN_DIR/global_step_N), a run folder (its latest checkpoint), a "
                                 "Hugging Face folder (e.g. from `posttrain export`) or a hub id")
    p.add_argument("--data", nargs="+", default=[], help="parquet/jsonl files in the RL data layout")
    p.add_argument("--output", "-o", default="eval_samples.jsonl",
                   help="JSONL of every sample; the metrics go beside it as <name>.metrics.json")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (mean@n, maj@n, pass@k)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (needs --n 1)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-length", type=int, default=1024, help="longer prompts are an error")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generate call")
    p.add_argument("--max-samples", type=int, default=-1, help="the first N rows only (-1: all)")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--reward-fn", default=None, help="a custom scorer file (like custom_reward_function.path)")
    p.add_argument("--reward-fn-name", default="compute_score")
    p.add_argument("--num-workers", type=int, default=None,
                   help="scorer processes (default: as training picks; 0: score in this process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--missing-chat-template", default="error", choices=["error", "join"])
    p.add_argument("--multi-turn", action=argparse.BooleanOptionalAction, default=None,
                   help="run episodes with tools and environments (default: as the checkpoint's run did)")
    p.add_argument("--tool-config", default=None,
                   help="a tool YAML (multi_turn.tool_config_path); implies --multi-turn")
    p.add_argument("--function-tools", default=None,
                   help="a file of @function_tool functions (multi_turn.function_tool_path); implies --multi-turn")
    p.add_argument("--agent", default=None,
                   help="the environment of rows without an agent_name column (rollout.agent.default_agent_loop); "
                   "implies --multi-turn")
    p.add_argument("--max-assistant-turns", type=int, default=None,
                   help="the most policy turns of an episode; implies --multi-turn")
    p.add_argument("--program", default=None,
                   help="an agent program plays each sample against a server over the model, as in training "
                   "(rollout.agent.program: module:function, file.py:function or a command line)")
    p.add_argument("--environment", default=None,
                   help="a verifiers taskset (data.environment=verifiers:...) in place of --data: its last "
                   "--max-samples tasks (those training holds out), played by its own program")
    p.add_argument("--program-timeout", type=float, default=None,
                   help="seconds per program run (rollout.agent.program_timeout_s; default: training's)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("serve", help="an OpenAI-compatible server (chat and text completions) over a model: "
                                      "docs/serve.md")
    p.add_argument("model", help="what `posttrain eval` takes: a checkpoint, a run folder, an HF folder or a hub id")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0: a free port (the printed URL names it)")
    p.add_argument("--api-key", default=None, help="clients must send Authorization: Bearer KEY (default: no key)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL as given)")
    p.add_argument("--max-running", type=int, default=64, help="samples decoding at once")
    p.add_argument("--max-waiting", type=int, default=256, help="requests waiting for room; more are refused (429)")
    p.add_argument("--prefix-cache-tokens", type=int, default=32768,
                   help="tokens whose keys and values are kept for requests continuing a conversation (0: off)")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a request running longer is cancelled and answered 504")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="a larger request body is refused (413)")
    p.add_argument("--read-timeout-s", type=float, default=30.0,
                   help="a request's headers, and then its body, must arrive within it (else 408 and closed)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="open connections; one more is answered 503 (default: the open-file limit less 128)")
    p.add_argument("--shutdown-grace-s", type=float, default=5.0,
                   help="on SIGTERM / SIGINT, the time requests in flight have to finish; then they fail (503)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("plot", help="PNG charts of the standard metrics of one or more runs, overlaid")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="folders holding metrics.jsonl")
    p.add_argument("--output-dir", "-o", default=None,
                   help="where the PNGs go (default: RUN_DIR/plots for one run, ./plots for several)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("report", help="one self-contained HTML page of a run: curves, reward-hacking detectors, "
                                       "flagged samples as conversations, the config")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (metrics.jsonl, config.yaml, watch/)")
    p.add_argument("--output", "-o", default=None, help="where the page goes (default: RUN_DIR/report.html)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("runs", help="a table of the runs in a folder: algorithm, steps, last reward and accuracy")
    p.add_argument("folder", nargs="?", default="checkpoints",
                   help="searched for run folders (default: checkpoints, where runs go by default)")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("episodes", help="the episodes a multi-turn run logged at a step: messages, tool calls and "
                                        "results, rewards")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (its episodes/step_N.jsonl)")
    p.add_argument("--step", type=int, default=None, help="which step (default: the latest with episodes)")
    p.add_argument("--index", type=int, default=None, help="only this episode (0-based)")
    p.add_argument("--limit", type=int, default=10, help="at most this many episodes (default 10)")
    p.set_defaults(func=cmd_episodes)

    p = sub.add_parser("sandbox-server", help="serve the code sandbox over SandboxFusion's HTTP API (POST /run_code)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--max-workers", type=int, default=max(1, os.cpu_count() or 1),
                   help="programs run at the same time (further requests wait)")
    p.add_argument("--allow-unsandboxed", action="store_true",
                   help="UNSAFE: run programs without isolation where bubblewrap cannot start")
    p.set_defaults(func=cmd_sandbox_server)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A bad input (config, data, files, reward function) prints one message and returns 2; a
    run stopped by non-finite losses or gradients returns 1 with the quantity named; anything else is a bug and
    keeps its traceback."""
    from .config import ConfigError
    from .data.rows import DataError
    from .parallel.launch import WorkerFailed
    from .reward.sandbox import SandboxUnavailable
    from .reward.checks import RewardError
    from .reward.registry import UnknownDataSourceError
    from .roles.nonfinite import NonFiniteError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (DataError, UnknownDataSourceError) as e:  # every rank reads the same rows: rank 0 says it
        _say(f"data error: {e}")
        return 2
    except FileNotFoundError as e:  # export / prepare: a path given on the command line
        print(f"error: {e.strerror + ': ' + str(e.filename) if e.filename else e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # decided on the global gradient norm: the same on every rank
        _say(f"error: {e}")
        return 1
    except WorkerFailed as e:
        if e.exitcode == 2:  # a worker rejected an input and said which above
            print(f"stopped: rank {e.rank} rejected an input (its message is above); every rank was stopped",
                  file=sys.stderr)
            return 2
        print(f"error: {e}", file=sys.stderr)
        return 1
    except SandboxUnavailable as e:  # every rank checks the same rows
        _say(f"error: {e}")
        return 2
    except RewardError as e:  # decided on the gathered batch: the same on every rank
        _say(f"reward error: {e}")
        return 1
    except _run_stops() as e:  # evaluated only when something was raised
        return _stopped(e)


def _signals_at_start_up(argv: list[str]) -> None:
    """A training command's process, from its first line (before torch is imported): a signal before the first step
    ends it with a message and 128 + the signal number, not the signal's silent default."""
    if argv[:1] == ["train"]:
        from .trainer.preempt import exit_before_first_step

        exit_before_first_step()


def entry() -> None:
    """The `posttrain` command: `main`, then `exit_process` (a process that ran collectives ends without the
    interpreter's teardown; `main` itself returns, for callers in the same process)."""
    _signals_at_start_up(sys.argv[1:])
    from .parallel.context import exit_process

    exit_process(main())


if __name__ == "__main__":
    _signals_at_start_up(sys.argv[1:])
    from .parallel.context import exit_process
    from .parallel.launch import recorded

    exit_process(recorded(main)())
