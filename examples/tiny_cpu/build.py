"""Build the offline stand-ins the `*_tiny_cpu.sh` scripts train with, once, into one folder:

    python examples/tiny_cpu/build.py DIR

DIR/model          a tiny random Qwen2 causal LM (0.1M parameters) and its BPE tokenizer, in place of Qwen2.5-*
DIR/reward_model   a tiny random Qwen2 sequence classifier with one label, in place of a reward model
DIR/raw            GSM8K- and MATH-format originals (two-digit additions), what `posttrain prepare` reads
DIR/data           `posttrain prepare` run on them: gsm8k/{train,test}, math/test and code/{train,test} (.parquet);
                   the tool-agent layout (`--tools`): gsm8k_tools/{train,test}, math_tools/{train,test}; and
                   search_qa/{train,test}.jsonl, the local-search example's questions (examples/multiturn/data)

Nothing is downloaded. The folder is written beside DIR and renamed into place, so a finished DIR is complete.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from posttrain.data.preprocess import gsm8k as gsm8k_layout, math as math_layout, prepare
from posttrain.data.synthetic import tokenizer_corpus
from posttrain.models.tiny import build_tiny_model, build_tiny_reward_model

SEARCH_QA = Path(__file__).resolve().parents[1] / "multiturn" / "data" / "search_qa"
COMPLETE = "data/search_qa"  # what a build writes last: an older build without it is rebuilt
# 4 attention heads and 2 KV heads: tensor parallel 2 divides them
SIZES = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def additions(seed: int, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_raw(raw: Path) -> None:
    """Originals in the public formats: GSM8K `question`/`answer` (`#### N`), MATH-500 `problem`/`solution`/`answer`
    (test split only, as MATH-500 is), and a MATH-format train and test split for the code-interpreter example."""
    for split, seed, n in (("train", 0, 64), ("test", 1, 16)):
        write_jsonl(raw / "gsm8k" / f"{split}.jsonl",
                    [{"question": f"{a}+{b}=?", "answer": f"{a}+{b}={a + b}\n#### {a + b}"}
                     for a, b in additions(seed, n)])
    write_jsonl(raw / "math500" / "test.jsonl",
                [{"problem": f"{a}+{b}=?", "solution": f"${a}+{b}=\\boxed{{{a + b}}}$", "answer": str(a + b),
                  "subject": "Prealgebra", "level": 1, "unique_id": f"tiny/{i}.json"}
                 for i, (a, b) in enumerate(additions(2, 16))])
    for split, seed, n in (("train", 3, 64), ("test", 4, 16)):
        write_jsonl(raw / "math" / f"{split}.jsonl",
                    [{"problem": f"{a}+{b}=?", "solution": f"${a}+{b}=\\boxed{{{a + b}}}$", "answer": str(a + b)}
                     for a, b in additions(seed, n)])


def search_system_prompt() -> str:
    return json.loads((SEARCH_QA / "train.jsonl").read_text().splitlines()[0])["prompt"][0]["content"]


def build(out: Path) -> Path:
    if (out / COMPLETE).is_dir():
        return out
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    # the prompts' words in the corpus keep prompts short in tokens
    texts = tokenizer_corpus(0, 500) + [gsm8k_layout.INSTRUCTION, math_layout.INSTRUCTION, gsm8k_layout.TOOL_SYSTEM,
                                        gsm8k_layout.TOOL_INSTRUCTION, math_layout.TOOL_SYSTEM,
                                        search_system_prompt()] * 50
    build_tiny_model(tmp / "model", texts, seed=0, **SIZES)
    build_tiny_reward_model(tmp / "reward_model", texts, seed=1, **SIZES)
    write_raw(tmp / "raw")
    prepare("gsm8k", tmp / "raw" / "gsm8k", tmp / "data" / "gsm8k")
    prepare("math", tmp / "raw" / "math500", tmp / "data" / "math")
    prepare("code", None, tmp / "data" / "code")
    prepare("gsm8k", tmp / "raw" / "gsm8k", tmp / "data" / "gsm8k_tools", tools=True)
    prepare("math", tmp / "raw" / "math", tmp / "data" / "math_tools", tools=True)
    shutil.copytree(SEARCH_QA, tmp / COMPLETE)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir():  # an older build, without the multi-turn data
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    print(build(parser.parse_args().dir.resolve()))


if __name__ == "__main__":
    main()
