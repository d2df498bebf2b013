"""`data.*`: the prompt files, their columns, lengths and batch sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

StrOrList = Union[str, list]


@dataclass
class SamplerConfig:
    class_path: Optional[str] = None
    """a sampler class of your own that orders the training prompts instead of `shuffle`, as verl's
    `create_rl_sampler` loads it: the module (`pkg://package.module`, or a file: `file://path.py` / `path.py`) holding
    `class_name`, built as `Class(data_source=<the training prompts>, data_config=<data.* as a DictConfig>)` and
    iterated for dataset indices, an epoch at a time, `data.train_batch_size` of them per step (its length sets the
    steps per epoch). A curriculum sampler (one with an `update(batch)` method, verl's `AbstractCurriculumSampler`)
    gets each trained step's whole batch (docs/porting.md says what it holds) before the next prompts are drawn.
    Every process draws the same indices (the random generators are seeded from `data.seed` around each draw). The
    class is imported when the config loads"""
    class_name: Optional[str] = None
    """the sampler class in `class_path` (both or neither)"""


@dataclass
class CustomClsConfig:
    path: Optional[str] = None
    """a dataset class of your own that makes the rows, as verl's `create_rl_dataset` loads it: the module
    (`pkg://package.module`, or a file: `file://path.py` / `path.py`) holding `name`, a `torch.utils.data.Dataset`
    built as `Class(data_files=<train_files or val_files>, tokenizer=..., processor=..., config=<data.* as a
    DictConfig>, max_samples=...)`; each item is read as a row of a data file (docs/porting.md). Without verl
    installed, `verl.utils.dataset.RLHFDataset` is posttrain's compatible base. The class is imported when the config
    loads"""
    name: Optional[str] = None
    """the dataset class in `path` (both or neither)"""


@dataclass
class DataConfig:
    train_files: Optional[StrOrList] = None
    """parquet or jsonl file, or a list of them (rows in the layout of DESIGN.md)"""
    val_files: Optional[StrOrList] = None
    """validation files; null = no validation"""
    environment: Optional[str] = None
    """`verifiers:<module or taskset id>` (or `verifiers:pkg.module:TasksetClass`,
    `verifiers:path/to/file.py:TasksetClass`): the prompts are a verifiers
    taskset's tasks and each episode is its rollout, played against the policy's OpenAI-compatible server and scored
    by the task's rubric (docs/agents.md). Takes the place of `train_files` / `val_files` (set neither); a taskset has
    no splits, so its last `val_max_samples` tasks are held out for validation (-1: no validation). Needs
    `pip install 'posttrain[verifiers]'`"""
    prompt_key: str = "prompt"
    """column holding the chat messages (or a plain string)"""
    reward_fn_key: str = "data_source"
    """column that selects the rule scorer"""
    max_prompt_length: int = 512
    """prompt tokens after the chat template"""
    max_response_length: int = 512
    """generated tokens; also `C` of `seq-mean-token-sum-norm`"""
    train_batch_size: int = 1024
    """prompts per step (each sampled `rollout.n` times)"""
    val_batch_size: Optional[int] = None
    """prompts per validation generate call; null = all at once"""
    shuffle: bool = True
    """shuffle training prompts each epoch (seeded by `seed`)"""
    seed: int = 1
    """data order seed"""
    filter_overlong_prompts: bool = False
    """drop prompts longer than `max_prompt_length` at load time (counted)"""
    truncation: str = "error"
    """too-long prompt: `error` (names file and row), `left`, `right`, `middle`"""
    return_raw_chat: bool = False
    """pass the chat messages to scorers as `extra_info["raw_prompt"]`. Multi-turn episodes start from the row's
    messages either way (verl's agent loop needs it True)"""
    image_key: str = "images"
    """column holding a row's images (a list of bytes, {"bytes", "path"} structs or paths), one per `<image>` in the
    prompt; needs a vision-language model (its processor makes the image tokens)"""
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    """extra arguments of the tokenizer's chat template (e.g. `enable_thinking`, `reasoning_effort`)"""
    train_max_samples: int = -1
    """use only the first N usable training rows (-1 = all)"""
    val_max_samples: int = -1
    """use only the first N usable validation rows (-1 = all)"""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)
    missing_chat_template: str = "error"
    """a tokenizer without a chat template: `error` (stop before training) or `join` (the message contents joined by
    newlines, for base models)"""
