"""Turn the original GSM8K / MATH files (and the bundled code problems) into train/test files in the RL data layout
(DESIGN.md, "Data layout").

Training reads one uniform row format whatever the benchmark; this is the one place that knows each benchmark's
original fields. Nothing is downloaded: input is the data kept beside the project (`shared/data`), the code problems
shipped in the package (`posttrain/data/code`), or a path you give.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ...progress import ProgressBar

# dataset name -> folder under shared/data holding its original files
DATASET_DIRS = {"gsm8k": "gsm8k", "math": "math500"}
SPLITS = ("train", "test")
FORMATS = ("parquet", "jsonl", "both")
EXTRA_DATASETS = ("code", "geo3k", "visual-count")  # not read from shared/data


def require_field(row: dict, field: str, path: Path | str, lineno: int) -> str:
    """A non-empty string field of an original row, or a ValueError naming file, line and field."""
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{path}: line {lineno} has no usable {field!r} field (got {value!r:.60})")
    return value


def find_shared_data(start: str | Path | None = None) -> Path | None:
    """The `shared/data` folder beside the project: searched upward from `start` (default: the CWD), then upward
    from this package (the checkout lives at `<root>/main`, the data at `<root>/shared/data`)."""
    bases = [Path(start) if start is not None else Path.cwd(), Path(__file__).resolve().parent]
    for base in bases:
        base = base.resolve()
        for parent in (base, *base.parents):
            candidate = parent / "shared" / "data"
            if any((candidate / folder).is_dir() for folder in DATASET_DIRS.values()):
                return candidate
    return None


def _split_files(name: str, source: Path) -> dict[str, Path]:
    """{split: original file} for a dataset, from a file, a dataset folder, or a shared/data-style root folder."""
    if source.is_file():
        # "test.jsonl", "gsm8k_test.jsonl" -> test; a lone file of any other name is taken as training data
        split = "test" if re.search(r"(^|[^a-z])test([^a-z]|$)", source.stem.lower()) else "train"
        return {split: source}
    if not source.is_dir():
        raise FileNotFoundError(f"input not found: {source}")
    folder = source / DATASET_DIRS[name] if (source / DATASET_DIRS[name]).is_dir() else source
    files = {split: folder / f"{split}.jsonl" for split in SPLITS if (folder / f"{split}.jsonl").is_file()}
    if not files:
        expected = ", ".join(str(folder / f"{s}.jsonl") for s in SPLITS)
        raise FileNotFoundError(f"no {name} input file found: expected one of {expected}")
    return files


def _write(rows: list[dict], out_dir: Path, split: str, fmt: str) -> Path:
    """Write one split; via a temporary file so an interrupted run never leaves a half-written file behind."""
    written = None
    if fmt in ("jsonl", "both"):
        path = out_dir / f"{split}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
        written = path
    if fmt in ("parquet", "both"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = out_dir / f"{split}.parquet"
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
        written = path
    return written


def _prepare_images(name: str, source, output_dir, fmt: str) -> dict[str, tuple[Path | None, int]]:
    """Datasets with images (parquet only: the images are bytes). geo3k converts the original files given;
    visual-count writes the synthetic counting task (synthetic_visual.py; its SFT demonstrations as `sft_train`)."""
    if fmt != "parquet":
        raise ValueError(f"{name} holds images, which only parquet files carry; use --format parquet")
    out_dir = Path(output_dir) if output_dir is not None else Path("data") / name
    if name == "visual-count":
        if source is not None:
            raise ValueError("visual-count is generated, it reads no input; leave out --input")
        from ..synthetic_visual import write_visual_task

        paths = write_visual_task(out_dir)
        import pyarrow.parquet as pq

        return {split: (path, pq.read_metadata(path).num_rows) for split, path in paths.items()}
    from .geo3k import convert, split_files

    if source is None:
        raise FileNotFoundError("geo3k reads the original geometry3k parquet files: pass their folder or one file "
                                "with --input")
    files = split_files(Path(source).expanduser())
    converted = {split: convert(path, split) for split, path in files.items()}  # all parsed before any write
    out_dir.mkdir(parents=True, exist_ok=True)
    return {split: ((_write(converted[split], out_dir, split, fmt), len(converted[split])) if split in converted
                    else (None, 0)) for split in SPLITS}


def prepare(name: str, input_dir_or_file: str | Path | None = None, output_dir: str | Path | None = None,
            fmt: str = "parquet", *, tools: bool = False, quiet: bool = True) -> dict[str, tuple[Path | None, int]]:
    """Convert dataset `name` ("gsm8k", "math", or "code": the bundled code problems) and write `<split>.parquet`
    (fmt="jsonl": `.jsonl`; "both": both).

    Input defaults to the shared data folder; output defaults to `data/<name>` under the CWD. Returns
    {split: (path written, rows)}. A split whose original file does not exist is listed as (None, 0) so the absence
    is visible: MATH-500 is a test set only, so "math" yields test rows and `train: (None, 0)`. With fmt="both" the
    path is the parquet file; the jsonl file lies beside it. `quiet=False` shows a progress bar (a unit per split
    read and per split written). `tools=True` (gsm8k, math) writes the tool-agent layout instead (agent_name
    `tool_agent`, a system prompt offering the tool: TOOL_SYSTEM in gsm8k.py and math.py, extra_info.tools_kwargs),
    by default to `data/<name>_tools`.
    """
    if name not in DATASET_DIRS and name not in EXTRA_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted([*DATASET_DIRS, *EXTRA_DATASETS])}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {list(FORMATS)}")
    if tools and name not in DATASET_DIRS:
        raise ValueError(f"the tool-agent layout (--tools) is written for {sorted(DATASET_DIRS)}, not {name!r}")
    if name in ("geo3k", "visual-count"):
        return _prepare_images(name, input_dir_or_file, output_dir, fmt)
    if name == "code":
        from .code import BUNDLED, convert as convert_code

        source = Path(input_dir_or_file).expanduser() if input_dir_or_file is not None else BUNDLED
        if not source.is_file():
            raise FileNotFoundError(f"input not found: {source} (the code problems are one jsonl file)")
        out_dir = Path(output_dir) if output_dir is not None else Path("data") / name
        with ProgressBar(f"prepare {name}", 2 * len(SPLITS), unit="stages", enabled=not quiet, stderr=True) as bar:
            converted = {}
            for split in SPLITS:
                converted[split] = convert_code(source, split)
                bar.advance()
            out_dir.mkdir(parents=True, exist_ok=True)
            summary = {}
            for split in SPLITS:
                summary[split] = ((_write(converted[split], out_dir, split, fmt), len(converted[split]))
                                  if converted[split] else (None, 0))
                bar.advance()
        return summary
    if input_dir_or_file is None:
        shared = find_shared_data()
        if shared is None:
            raise FileNotFoundError("no shared/data folder found above the current directory or the posttrain "
                                    "package; pass the original file or folder explicitly (--input)")
        source = shared / DATASET_DIRS[name]
    else:
        source = Path(input_dir_or_file).expanduser()
    if name == "gsm8k":
        from .gsm8k import convert
    else:
        from .math import convert

    files = _split_files(name, source)
    out_dir = Path(output_dir) if output_dir is not None else Path("data") / (f"{name}_tools" if tools else name)
    summary: dict[str, tuple[Path | None, int]] = {}
    with ProgressBar(f"prepare {name}", 2 * len(files), unit="stages", enabled=not quiet, stderr=True) as bar:
        converted = {}
        for split, path in files.items():  # all parsed before anything is written
            converted[split] = convert(path, split, tools)
            bar.advance()
        out_dir.mkdir(parents=True, exist_ok=True)
        for split in SPLITS:
            if split in converted:
                summary[split] = (_write(converted[split], out_dir, split, fmt), len(converted[split]))
                bar.advance()
            else:
                summary[split] = (None, 0)
    return summary
