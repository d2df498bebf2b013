"""Port check: run verl's example scripts with posttrain as the entry point and report which load.

    python tools/verl_examples.py capture EXAMPLES_DIR tests/data/verl_examples   # record each script's arguments
    python tools/verl_examples.py check tests/data/verl_examples [--steps 2]      # load (and train) each one

`capture` runs every `*.sh` under EXAMPLES_DIR with `python`/`python3` replaced by a shim that records the arguments
of `-m verl.trainer.main_ppo` and runs nothing; model and data paths are replaced by placeholders, nothing else.
The recording machine stands for one with NVIDIA GPUs: `uv run ... python3` runs the shim, a `python3 -c` probe
(`import torch_npu`) fails, and the paths some scripts require from the environment are set (SCRIPT_ENV). Each
recording is named after the script's path under EXAMPLES_DIR, `/` written `__`.
`check` substitutes the placeholders (a tiny model and the demo task's files) and loads each command line with
`posttrain train --print-config`; with `--steps N` the ones that load also train N steps with small batch sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL, TRAIN, VAL, REWARD = "$MODEL_PATH", "$TRAIN_FILES", "$VAL_FILES", "$REWARD_MODEL_PATH"
ADAPTER = "$LORA_ADAPTER_PATH"
PATH_KEYS = {"model.path": MODEL, "tokenizer_path": MODEL, "model.tokenizer_path": MODEL,
             "model.input_tokenizer": MODEL, "model_path": MODEL, "data.train_files": TRAIN, "data.val_files": VAL,
             "lora_adapter_path": ADAPTER}
SHIM = """#!/usr/bin/env bash
for a in "$@"; do if [ "$a" = "verl.trainer.main_ppo" ]; then
  python_real=%(python)s; exec "$python_real" -c 'import json,sys; sys.argv.pop(0); i=sys.argv.index("verl.trainer.main_ppo"); open(__import__("os").environ["POSTTRAIN_CAPTURE"],"a").write(json.dumps(sys.argv[i+1:])+"\\n")' "$@"
fi; done
[ "$1" = -c ] && exit 1  # a probe (`python3 -c 'import torch_npu'`) fails: the recording machine has NVIDIA GPUs
exit 0
"""
# Paths some scripts require from the environment (they stop with "unbound variable" or "must set" without them),
# and INFER_BACKEND, which one script reads before it sets its own default (vllm).
SCRIPT_ENV = {"RAY_DATA_HOME": "HOME/verl", "HDFS_ROOT": "HOME/hdfs", "LORA_ADAPTER_PATH": "HOME/lora_adapter",
              "KIMI_K2_6_MODEL_PATH": "HOME/models/Kimi-K2.6", "DATA_ROOT": "HOME/data",
              "INFER_BACKEND": "vllm"}


def _placeholder(arg: str) -> str:
    key, eq, value = arg.partition("=")
    if not eq:
        return arg
    bare = key.lstrip("+")
    for suffix, placeholder in PATH_KEYS.items():
        if bare == suffix or bare.endswith("." + suffix):
            if bare in ("reward_model.model.path", "reward.reward_model.model_path"):
                return f"{key}={REWARD}"  # a reward model is a model of its own
            return f"{key}={placeholder}"
    return arg


def capture(examples: Path, out_dir: Path, root: Path | None = None) -> None:
    """Record every script under `examples`; each runs from `root` (the checkout, for scripts that find their config
    files from the current folder) or from an empty folder."""
    out_dir.mkdir(parents=True, exist_ok=True)
    checkout = (root or examples.parent).resolve()
    scripts = sorted(examples.rglob("*.sh"))
    for script in scripts:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            record = tmp / "argv.jsonl"
            bindir = tmp / "bin"
            bindir.mkdir()
            for name in ("python", "python3"):
                shim = bindir / name
                shim.write_text(SHIM % {"python": sys.executable})
                shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
            # `uv run [options] python3 ...` runs the python that follows
            (bindir / "uv").write_text('#!/usr/bin/env bash\nwhile [ $# -gt 0 ] && [ "$1" != python ] && '
                                       '[ "$1" != python3 ]; do shift; done\n[ $# -gt 0 ] && exec "$@"\nexit 0\n')
            (bindir / "uv").chmod(0o755)
            for name in ("nvidia-smi", "ray", "huggingface-cli", "hf", "pip", "nsys", "wandb"):
                (bindir / name).write_text("#!/bin/sh\nexit 0\n")
                (bindir / name).chmod(0o755)
            env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp / "home"), "TMPDIR": str(tmp),
                   "POSTTRAIN_CAPTURE": str(record),
                   **{k: v.replace("HOME", str(tmp / "home")) for k, v in SCRIPT_ENV.items()}}
            # `source` of a file this machine lacks (a vendor toolkit's env script) and a `ulimit` this machine does
            # not allow must not stop the script
            tolerant = ('source() { [ -f "$1" ] && builtin source "$@"; return 0; }; export -f source; '
                        'ulimit() { builtin ulimit "$@" 2>/dev/null || true; }; export -f ulimit; bash "$0"')
            subprocess.run(["bash", "-c", tolerant, str(script)], cwd=root or tmp, env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
            lines = record.read_text().splitlines() if record.exists() else []
            # stable across runs: the recording machine's home folder and the checkout the scripts lie in
            lines = [line.replace(str(tmp / "home"), "/home/user").replace(str(checkout), "/path/to/verl")
                     for line in lines]
        name = str(script.relative_to(examples).with_suffix(".json")).replace("/", "__")
        if not lines:
            print(f"{script.relative_to(examples)}: no main_ppo call recorded", file=sys.stderr)
            continue
        argv = [_placeholder(a) for a in json.loads(lines[0]) if a.strip()]
        (out_dir / name).write_text(json.dumps({"script": str(script.relative_to(examples)), "argv": argv},
                                               indent=1) + "\n")
    print(f"{len(scripts)} scripts -> {out_dir}")


SMALL = ["data.train_batch_size=4", "data.val_batch_size=4", "data.max_prompt_length=256",
         "data.max_response_length=16", "data.filter_overlong_prompts=True", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=4",
         "critic.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
         "actor_rollout_ref.actor.fsdp_config.tp_size=1", "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1",
         "actor_rollout_ref.ref.fsdp_config.fsdp_size=-1", "actor_rollout_ref.rollout.prompt_length=256",
         "actor_rollout_ref.rollout.response_length=16", "trainer.total_training_steps=STEPS",
         "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.save_freq=-1",
         "trainer.logger=['console']", "trainer.default_local_dir=RUN_DIR", "trainer.device=cpu",
         "reward_model.overlong_buffer.len=4"]


def substitute(argv: list[str], model: str, train: str, val: str, reward: str, adapter: str = ADAPTER) -> list[str]:
    return [a.replace(REWARD, reward).replace(MODEL, model).replace(TRAIN, train).replace(VAL, val)
            .replace(ADAPTER, adapter) for a in argv]


def check(args_dir: Path, model: str, train: str, val: str, reward: str, steps: int, adapter: str = ADAPTER) -> int:
    """Load every recorded command line; with steps > 0 also train that many steps. Prints one line per script
    and the reasons for those that do not load."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    loaded, failed = [], {}
    files = sorted(args_dir.glob("*.json"))
    for f in files:
        record = json.loads(f.read_text())
        argv = substitute(record["argv"], model, train, val, reward, adapter)
        start = time.time()
        out = subprocess.run([sys.executable, "-m", "posttrain", "train", "--print-config", *argv], env=env,
                             capture_output=True, text=True)
        if out.returncode != 0:
            failed[record["script"]] = out.stderr.strip()
            print(f"FAIL  {record['script']}", flush=True)
            continue
        status = "loads"
        if steps > 0:
            with tempfile.TemporaryDirectory() as run_dir:
                small = [s.replace("STEPS", str(steps)).replace("RUN_DIR", run_dir) for s in SMALL]
                run = subprocess.run([sys.executable, "-m", "posttrain", "train", *argv, *small], env=env,
                                     capture_output=True, text=True)
                ok = run.returncode == 0 and (Path(run_dir) / "metrics.jsonl").exists()
                status = f"trained {steps} steps" if ok else "LOADS BUT TRAINING FAILED: " + run.stderr[-400:]
        loaded.append(record["script"])
        print(f"ok    {record['script']}: {status} ({time.time() - start:.0f} s)", flush=True)
    print(f"\n{len(loaded)} of {len(files)} load")
    for script, reason in failed.items():
        print(f"\n{script}:\n{reason}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("capture")
    p.add_argument("examples", type=Path)
    p.add_argument("out_dir", type=Path)
    p.add_argument("--root", type=Path, default=None, help="run the scripts from this folder (the checkout), as "
                   "scripts that find their config files from the current folder expect")
    p = sub.add_parser("check")
    p.add_argument("args_dir", type=Path)
    p.add_argument("--model", required=True, help="model directory standing in for every script's model")
    p.add_argument("--train", required=True, help="training file standing in for every script's data")
    p.add_argument("--val", default=None, help="validation file (default: --train)")
    p.add_argument("--reward-model", default=None, help="reward model standing in for the scripts' (default: --model)")
    p.add_argument("--steps", type=int, default=0, help="also train this many steps with small batch sizes")
    p.add_argument("--lora-adapter", default=ADAPTER, help="a saved LoRA adapter of --model standing in for the "
                   "scripts' (lora_adapter_path)")
    args = parser.parse_args()
    if args.command == "capture":
        capture(args.examples, args.out_dir, args.root)
        return 0
    return check(args.args_dir, args.model, args.train, args.val or args.train, args.reward_model or args.model,
                 args.steps, args.lora_adapter)


if __name__ == "__main__":
    sys.exit(main())
