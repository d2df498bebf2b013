"""Geometry3K original rows (the hiyouga/geometry3k parquet files: `images`, `problem`, `answer`) -> rows of the
vision-language data layout, scored by the `\\boxed{}` math scorer.

The problem text already holds the `<image>` placeholder where its figure goes; the instruction asking for
reasoning in <think> tags and the answer in `\\boxed{}` is the one of the common geo3k recipe.
"""

from __future__ import annotations

from pathlib import Path

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
               r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE "
               r"put in \boxed{}.")


def split_files(source: Path) -> dict[str, Path]:
    """{split: parquet file} from one file (its name says test or train) or a folder of the original files
    (`data/train-*.parquet`, `test-*.parquet`; the validation split is not used)."""
    if source.is_file():
        return {"test" if "test" in source.name.lower() else "train": source}
    if not source.is_dir():
        raise FileNotFoundError(f"input not found: {source}")
    files = {}
    for split in ("train", "test"):
        found = sorted(p for p in source.rglob("*.parquet") if p.name.lower().startswith(split))
        if len(found) > 1:
            raise ValueError(f"{source}: several {split} files ({', '.join(str(p) for p in found)}); give one")
        if found:
            files[split] = found[0]
    if not files:
        raise FileNotFoundError(f"no geometry3k files in {source}: expected train-*.parquet and test-*.parquet")
    return files


def convert(input_path: str | Path, split: str) -> list[dict]:
    """All rows of one original parquet file in the layout (images kept as {"bytes", "path"} structs)."""
    import pyarrow.parquet as pq

    rows = []
    for index, original in enumerate(pq.read_table(input_path).to_pylist()):
        where = f"{input_path}: row {index}"
        problem, answer, images = original.get("problem"), original.get("answer"), original.get("images")
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"{where} has no usable 'problem' field (got {problem!r:.60})")
        if answer is None or not str(answer).strip():
            raise ValueError(f"{where} has no usable 'answer' field (got {answer!r:.60})")
        if not isinstance(images, list) or not images:
            raise ValueError(f"{where} has no 'images' (a list of images)")
        if problem.count("<image>") != len(images):
            raise ValueError(f"{where}: the problem has {problem.count('<image>')} <image> placeholders for "
                             f"{len(images)} images")
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": problem + " " + INSTRUCTION}],
                     "images": images, "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(answer).strip()},
                     "extra_info": {"split": split, "index": index, "answer": str(answer).strip(),
                                    "question": problem}})
    return rows
