"""A dataset class of the user's (`data.custom_cls.path` / `name`), loaded and built as verl's `create_rl_dataset`
builds it: `Class(data_files=..., tokenizer=..., processor=..., config=<data.* as a DictConfig>, max_samples=...)`
(`max_samples` only where the constructor takes it), a `torch.utils.data.Dataset` whose items are row dicts.

Its rows are posttrain's rows: each item `ds[i]` is read as a row of a data file (the prompt messages under
`data.prompt_key`, else the `raw_prompt` verl's dataset adds; `data_source`, `reward_model.ground_truth`,
`extra_info`, `agent_name`), then tokenized with the chat template, filtered and truncated by the `data.*` keys as
any row. Tensors an item carries (verl's `input_ids`, `attention_mask`, `dummy_tensor`, ...) are not read: posttrain
encodes each row's messages itself (a note says so when an item has them).

Without verl installed, `from verl.utils.dataset import RLHFDataset` (or `verl.utils.dataset.rl_dataset`) gives
`RLHFDataset` below while the class's module loads: a base with verl's constructor, attributes and `__getitem__`
layout that reads the files with posttrain's reader into `self.dataframe`, a small table with the `datasets.Dataset`
methods subclasses call (`map`, `filter`, `select`, `column_names`), so a subclass that overrides
`_read_files_and_tokenize` or `__getitem__` runs. A module that needs more of verl (its vision utilities, tools,
reward functions) fails to import here, and the config is refused at load with that import error.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import Dataset

from .dataset import read_rows
from .verl_compat import verl_imports_answered

PKG, FILE = "pkg://", "file://"


class Rows:
    """A table of row dicts with the methods of `datasets.Dataset` that dataset classes call on `self.dataframe`."""

    def __init__(self, rows: Iterable[dict]):
        self._rows = list(rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i: int) -> dict:
        return copy.deepcopy(self._rows[int(i)])  # an item a caller changes leaves the table as it was

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    @property
    def column_names(self) -> list[str]:
        return list(dict.fromkeys(k for row in self._rows for k in row))

    def map(self, function: Callable, fn_kwargs: dict | None = None, remove_columns=None, **_ignored) -> "Rows":
        """Each row through `function(row, **fn_kwargs)`: its returned dict updates the row (the `remove_columns`
        dropped first), as `datasets.Dataset.map` (`num_proc`, `desc`, ... change nothing here)."""
        drop = {remove_columns} if isinstance(remove_columns, str) else set(remove_columns or ())
        out = []
        for row in self:
            new = function(row, **(fn_kwargs or {}))
            kept = {k: v for k, v in row.items() if k not in drop}
            out.append({**kept, **(new if new is not None else {})})
        return Rows(out)

    def filter(self, function: Callable, fn_kwargs: dict | None = None, **_ignored) -> "Rows":
        return Rows(row for row in self if function(row, **(fn_kwargs or {})))

    def select(self, indices: Iterable[int]) -> "Rows":
        return Rows(self[i] for i in indices)


class RLHFDataset(Dataset):
    """verl's `RLHFDataset` as a base for a user's class: the same constructor and attributes, the files read by
    posttrain's reader (parquet, jsonl), `__getitem__` the row with verl's `raw_prompt`, `index`, `tools_kwargs` and
    `interaction_kwargs`. Prompts are encoded, filtered and truncated by posttrain afterwards, so
    `maybe_filter_out_long_prompts` returns the rows as they are."""

    def __init__(self, data_files, tokenizer, config, processor=None, max_samples: int = -1):
        self.data_files = list(data_files) if isinstance(data_files, (list, tuple)) else [data_files]
        self.original_data_files = list(self.data_files)
        self.tokenizer, self.processor, self.config, self.max_samples = tokenizer, processor, config, max_samples
        get = config.get
        self.prompt_key = get("prompt_key", "prompt")
        self.image_key = get("image_key", "images")
        self.video_key = get("video_key", "videos")
        self.max_prompt_length = get("max_prompt_length", 1024)
        self.return_raw_chat = get("return_raw_chat", False)
        self.truncation = get("truncation", "error")
        self.filter_overlong_prompts = get("filter_overlong_prompts", True)
        self.apply_chat_template_kwargs = get("apply_chat_template_kwargs", None) or {}
        self.need_tools_kwargs = get("need_tools_kwargs", False)
        self.shuffle, self.seed = get("shuffle", False), get("seed", None)
        self.serialize_dataset = False
        self._download()
        self._read_files_and_tokenize()

    def _download(self, use_origin_parquet: bool = False) -> None:
        """verl copies remote files to a local cache; posttrain reads local files (nothing to do)."""

    def _read_files_and_tokenize(self) -> None:
        self.dataframe = Rows(row for path in self.data_files for row in read_rows(str(path)))
        if 0 < self.max_samples < len(self.dataframe):
            self.dataframe = self.dataframe.select(range(self.max_samples))
        self.dataframe = self.maybe_filter_out_long_prompts(self.dataframe)

    def maybe_filter_out_long_prompts(self, dataframe=None):
        return dataframe

    def resume_dataset_state(self) -> None:
        self._read_files_and_tokenize()

    def __len__(self) -> int:
        return len(self.dataframe)

    def _build_messages(self, example: dict, key: str | None = None):
        return example[key or self.prompt_key]

    def __getitem__(self, item):
        row = dict(self.dataframe[item])
        row["raw_prompt"] = self._build_messages(row, key=self.prompt_key)
        extra = row.get("extra_info") or {}
        row["extra_info"] = extra
        row["index"] = extra.get("index", 0)
        row["tools_kwargs"] = extra.get("tools_kwargs", {})
        row["interaction_kwargs"] = extra.get("interaction_kwargs", {})
        return row


def load_dataset_class(path: str, name: str) -> type:
    """The class `name` of the module `path` names (`pkg://package.module`, a file `file://path.py` or `path.py`),
    as verl's `load_extern_object` finds it, which must be a torch Dataset (verl's check); ValueError saying why
    not."""
    where = str(path)
    try:
        with verl_imports_answered():
            if where.startswith(PKG):
                module = importlib.import_module(where[len(PKG):].replace("/", "."))
            else:
                file = Path(where.removeprefix(FILE)).expanduser().resolve()
                if not file.is_file():
                    raise ValueError(f"no file {file}")
                spec = importlib.util.spec_from_file_location(f"_posttrain_dataset_{file.stem}", file)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
                spec.loader.exec_module(module)
    except ValueError:
        raise
    except (Exception, SystemExit) as e:  # whatever the user's module raises while it imports
        hint = (" (the module needs verl's own code: install verl, or write the class over "
                "verl.utils.dataset.RLHFDataset, which posttrain supplies)" if isinstance(e, ImportError)
                and "verl" in str(e) else "")
        raise ValueError(f"importing {where} failed: {type(e).__name__}: {e}{hint}") from None
    cls = getattr(module, str(name), None)
    if cls is None:
        raise ValueError(f"{where} has no {name!r}")
    if not isinstance(cls, type) or not issubclass(cls, Dataset):
        raise ValueError(f"{name} in {where} must be a class inheriting from torch.utils.data.Dataset (as verl "
                         "requires)")
    return cls


class CustomRows:
    """The rows of a user's dataset class, for `RLDataset` (which reads them as it reads a file's)."""

    def __init__(self, data_cfg, files, tokenizer, processor=None, max_samples: int = -1):
        self.cfg, self.files, self.tokenizer, self.processor = data_cfg, files, tokenizer, processor
        self.max_samples = max_samples
        self.notes: list[str] = []

    def __str__(self) -> str:
        return f"data.custom_cls {self.cfg.custom_cls.name} over {self.files}"

    __repr__ = __str__

    def build(self):
        from omegaconf import OmegaConf

        c = self.cfg.custom_cls
        cls = load_dataset_class(c.path, c.name)
        kwargs: dict[str, Any] = dict(data_files=list(self.files), tokenizer=self.tokenizer, processor=self.processor,
                                      config=OmegaConf.create(asdict(self.cfg)))
        if "max_samples" in inspect.signature(cls.__init__).parameters:
            kwargs["max_samples"] = self.max_samples
        try:
            with verl_imports_answered():
                return cls(**kwargs)
        except Exception as e:  # whatever the user's class raises
            raise ValueError(f"data.custom_cls.name={c.name}: building it failed: {type(e).__name__}: {e}") from e

    def rows(self) -> Iterator[dict]:
        """Each item of the class as a row: the messages under data.prompt_key (verl's `raw_prompt` where the item
        has no such column), tensors dropped."""
        dataset = self.build()
        key, tensors = self.cfg.prompt_key, set()
        for i in range(len(dataset)):
            item = dataset[i]
            if not isinstance(item, dict):
                raise ValueError(f"data.custom_cls.name={self.cfg.custom_cls.name}: item {i} is a "
                                 f"{type(item).__name__}, not a row dict")
            row = {k: v for k, v in item.items() if not isinstance(v, torch.Tensor)}
            tensors |= set(item) - set(row)
            if key not in row and "raw_prompt" in row:
                row[key] = row["raw_prompt"]
            yield row
        if tensors:
            self.notes.append(f"data.custom_cls.name={self.cfg.custom_cls.name}: the items' tensors "
                              f"({', '.join(sorted(tensors))}) are not read; posttrain encodes each row's messages "
                              "with the chat template")
