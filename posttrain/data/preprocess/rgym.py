"""reasoning-gym's procedural tasks -> train/test files in the RL data layout, scored by reward.rgym.

Problems are generated, not read: `--size N --seed S` builds each task's dataset with that seed; its first N
entries are the training rows, the next ones the test rows (M, the test size), skipping any test question that is
also a training question or an earlier test one. reasoning-gym draws entry i from seed S + i; a few tasks also
follow the order of Python's sets of strings (isomorphic_strings, knight_swap, word_ladder, ...), which changes from
one process to the next, so the rows are generated in a process with PYTHONHASHSEED=0 (this one when it already
runs so, else a child): the same command writes the same files, byte for byte. Each row keeps its whole entry and
the dataset's options, so that its scorer can rebuild both and call the task's own checker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ...reward import rgym

ABILITY = "reasoning"
# "none" drops the system turn and asks for the tags in the question's turn instead (shorter prompts).
NO_SYSTEM = "none"
TAG_INSTRUCTION = "\nGive your final answer between <answer> and </answer>."
RESERVED_OPTIONS = ("size", "seed")
TEST_DRAWS = 10  # at most this many entries drawn per test row asked for


def system_prompts() -> dict[str, str]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return dict(SYSTEM_PROMPTS)


def parse_tasks(text: str) -> list[str]:
    """`chain_sum,gcd` -> ["chain_sum", "gcd"], each a task reasoning_gym has, none named twice."""
    tasks = [t.strip() for t in str(text).split(",")]
    if not text or any(not t for t in tasks):
        raise ValueError(f"name the reasoning-gym tasks as TASK[,TASK...], e.g. chain_sum,gcd; got {text!r}")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        raise ValueError(f"task {twice} named more than once")
    for task in tasks:
        rgym.require_task(task)
    return tasks


def parse_options(items, tasks: list[str]) -> dict[str, dict]:
    """`["chain_sum.max_terms=2"]` (the `TASK.` may be left out when there is one task) -> {task: {key: value}};
    a value is read as JSON (2, 1.5, true, [1, 2]) and otherwise kept as text."""
    options: dict[str, dict] = {t: {} for t in tasks}
    for item in items or ():
        name, sep, raw = str(item).partition("=")
        task, dot, key = name.rpartition(".")
        if not dot and len(tasks) == 1:
            task = tasks[0]
        if not sep or not key or task not in options:
            raise ValueError(f"task option {item!r}: write TASK.KEY=VALUE with TASK one of {tasks} (e.g. "
                             f"{tasks[0]}.seed_offset=1; with one task, KEY=VALUE)")
        if key in RESERVED_OPTIONS:
            raise ValueError(f"task option {item!r}: {key} is set by --{key}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        options[task][key] = value
    return options


def _build(task: str, options: dict):
    """The task's dataset; a config key it does not have or a value it rejects is a ValueError naming the task."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[task][1]
    fields = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in RESERVED_OPTIONS)
    unknown = sorted(set(options) - set(fields) - set(RESERVED_OPTIONS))
    if unknown:
        raise ValueError(f"{task} has no option {unknown}; its options are {fields}")
    try:
        return rgym._library().create_dataset(task, **options)
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"{task} rejects the options {options}: {e or type(e).__name__}") from None


def _prompt(question: str, system: str) -> list[dict]:
    if system == NO_SYSTEM:
        return [{"role": "user", "content": question + TAG_INSTRUCTION}]
    return [{"role": "system", "content": system_prompts()[system]}, {"role": "user", "content": question}]


def _row(task: str, entry: dict, options_json: str, split: str, index: int, system: str) -> dict:
    answer = entry["answer"]
    try:
        encoded = rgym.encode_entry(entry)
    except TypeError as e:
        raise ValueError(f"{task}: entry {index} of {split} holds a value a data row cannot keep: {e}") from None
    # tasks with no single answer (graph_color, ...) have answer None: their checker verifies against the metadata
    truth = answer if isinstance(answer, str) else json.dumps(answer)
    return {"data_source": rgym.PREFIX + task, "prompt": _prompt(entry["question"], system), "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "task": task, "options": options_json, "entry": encoded}}


def task_rows(task: str, size: int, test_size: int, seed: int, options: dict, system: str) -> dict[str, list[dict]]:
    """{"train": size rows, "test": test_size rows} of one task. Test rows are the entries after the training ones,
    skipping any whose question is a training question or an earlier test one; up to TEST_DRAWS * test_size
    entries are drawn for them."""
    built = {**options, "size": size + TEST_DRAWS * test_size, "seed": seed}
    dataset = _build(task, built)
    options_json = json.dumps(built, sort_keys=True)
    train = [_row(task, dataset[i], options_json, "train", i, system) for i in range(size)]
    seen = {dataset[i]["question"] for i in range(size)} if test_size else set()
    test = []
    for i in range(size, size + TEST_DRAWS * test_size):
        if len(test) == test_size:
            break
        entry = dataset[i]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            test.append(_row(task, entry, options_json, "test", len(test), system))
    if len(test) < test_size:
        raise ValueError(f"{task}: only {len(test)} of {TEST_DRAWS * test_size} problems drawn for the test split "
                         f"differ from the training ones and each other, {test_size} were asked for (the task has "
                         f"few distinct problems with these options); lower --test-size or --size, or widen the "
                         f"task's options")
    return {"train": train, "test": test}


def _count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"--{name} must be an integer >= {low}, got {value!r}")
    return value


def prepare_reasoning_gym(tasks: str | list[str], size: int, seed: int, output_dir: str | Path | None = None,
                          fmt: str = "parquet", *, test_size: int | None = None, options=(),
                          system: str = "default", quiet: bool = True) -> dict[str, tuple[Path | None, int]]:
    """Write `train` and `test` files of reasoning-gym tasks (`size` training rows per task; `test_size` test rows
    per task, default size // 10, at least 1); returns {split: (path, rows)} as `prepare` does.

    `options`: "TASK.KEY=VALUE" settings of the tasks' configs; `system`: which of reasoning-gym's system prompts
    the rows carry (its SYSTEM_PROMPTS names), or "none" for none (the question then asks for the tags itself).
    Output defaults to data/reasoning_gym/<task>[+<task>...].
    """
    from . import FORMATS, SPLITS, _write
    from ...progress import ProgressBar

    names = parse_tasks(",".join(tasks) if isinstance(tasks, (list, tuple)) else tasks)
    size = _count("size", size, 1)
    seed = _count("seed", seed, 0)
    test_size = max(1, size // 10) if test_size is None else _count("test-size", test_size, 0)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    if system != NO_SYSTEM and system not in system_prompts():
        raise ValueError(f"unknown system prompt {system!r}; choose one of {[*system_prompts(), NO_SYSTEM]}")
    per_task = parse_options(options, names)
    out_dir = Path(output_dir) if output_dir is not None else Path("data") / "reasoning_gym" / "+".join(names)
    if sys.flags.hash_randomization:
        return _in_fixed_hash_process(names, size, seed, out_dir, fmt, test_size, list(options or ()), system, quiet)
    rows: dict[str, list[dict]] = {split: [] for split in SPLITS}
    with ProgressBar("prepare reasoning-gym", len(names) + len(SPLITS), unit="stages", enabled=not quiet,
                     stderr=True) as bar:
        for task in names:  # every task generated before anything is written
            for split, part in task_rows(task, size, test_size, seed, per_task[task], system).items():
                rows[split].extend(part)
            bar.advance()
        out_dir.mkdir(parents=True, exist_ok=True)
        summary = {}
        for split in SPLITS:
            summary[split] = (_write(rows[split], out_dir, split, fmt), len(rows[split])) if rows[split] else (None, 0)
            bar.advance()
    return summary


def _in_fixed_hash_process(names, size, seed, out_dir, fmt, test_size, options, system, quiet):
    """`prepare_reasoning_gym` run again in a child with PYTHONHASHSEED=0; its summary, or its error raised here."""
    import posttrain

    args = {"tasks": names, "size": size, "seed": seed, "output_dir": str(out_dir), "fmt": fmt,
            "test_size": test_size, "options": options, "system": system, "quiet": quiet}
    package_root = str(Path(posttrain.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONHASHSEED": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", __name__, json.dumps(args)], env=env, stdout=subprocess.PIPE,
                          text=True)
    lines = done.stdout.strip().splitlines()  # a task's generator may print; the answer is the last line
    try:
        answer = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError(f"generating the reasoning-gym rows failed (exit status {done.returncode}; its error "
                           "is above)") from None
    if "error" in answer:
        raise (ImportError if answer["error"] == "ImportError" else ValueError)(answer["message"])
    return {split: (Path(path) if path else None, rows) for split, (path, rows) in answer["summary"].items()}


if __name__ == "__main__":  # the child of _in_fixed_hash_process
    kwargs = json.loads(sys.argv[1])
    try:
        summary = prepare_reasoning_gym(kwargs.pop("tasks"), kwargs.pop("size"), kwargs.pop("seed"), **kwargs)
        print(json.dumps({"summary": {k: (str(p) if p else None, n) for k, (p, n) in summary.items()}}))
    except (ValueError, ImportError) as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
