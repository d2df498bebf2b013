"""`data.custom_cls.path` / `name`: a user's dataset class, loaded and built as verl's `create_rl_dataset` builds it,
over posttrain's `verl.utils.dataset.RLHFDataset` base where verl is not installed; its items are read as rows."""

import json
import sys
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
RETOOL = ROOT / "tests" / "data" / "multiturn_scripts_2026_04" / "recipe_retool" / "retool.py"
OK = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]

# verl-written classes: one over the base that reshapes the rows, one whose __getitem__ is its own (verl's layout:
# the messages as `raw_prompt`, tensors beside them), one that asks verl for more than posttrain supplies
CLASSES = '''
import torch
from torch.utils.data import Dataset
from verl.utils.dataset.rl_dataset import RLHFDataset


class Shouting(RLHFDataset):
    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        self.dataframe = self.dataframe.map(lambda row, suffix: {"prompt": [{"role": "user", "content":
            row["prompt"][-1]["content"].upper() + suffix}]}, fn_kwargs={"suffix": "!"}).select(range(3))


class OwnItems(Dataset):
    def __init__(self, data_files, tokenizer, config, processor=None):
        self.n, self.max_prompt_length = 5, config.max_prompt_length

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"raw_prompt": [{"role": "user", "content": f"add {i} and {i}"}], "data_source": "gsm8k",
                "reward_model": {"ground_truth": str(2 * i)}, "input_ids": torch.tensor([1, 2]),
                "extra_info": {"index": i}}


class NotADataset:
    pass
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The classes' module and 12 short rows in the standard layout (additions, scored by the gsm8k scorer)."""
    folder = tmp_path_factory.mktemp("custom_cls")
    (folder / "classes.py").write_text(CLASSES)
    (folder / "needs_verl.py").write_text("from verl.utils.torch_functional import masked_mean\n")
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {a} plus {a + 1}?"}],
             "reward_model": {"ground_truth": str(2 * a + 1)}, "extra_info": {"index": a}} for a in range(12)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, str(folder / "train.jsonl")


def rows_of(data, name, path, tokenizer, **data_keys):
    from posttrain.data.custom_dataset import CustomRows
    from posttrain.data.dataset import RLDataset

    cfg = load_config(None, OK + [f"data.custom_cls.path={path}", f"data.custom_cls.name={name}",
                                  *(f"data.{k}={v}" for k, v in data_keys.items())])
    source = CustomRows(cfg.data, [data], tokenizer, max_samples=8)
    return RLDataset(source, tokenizer, max_prompt_length=2048), source


def test_a_class_over_posttrain_s_base_reshapes_the_rows(files, tiny_tokenizer):
    """A subclass of verl's RLHFDataset (posttrain's base here) that maps its dataframe: the mapped rows are the run's
    prompts, built with verl's constructor (config a DictConfig with .get and attributes)."""
    from posttrain.data.dataset import read_rows

    folder, data = files
    dataset, _ = rows_of(data, "Shouting", folder / "classes.py", tiny_tokenizer)
    source = read_rows(data)
    assert len(dataset) == 3
    for item, row in zip(dataset, source):
        assert item.raw_prompt == [{"role": "user", "content": row["prompt"][-1]["content"].upper() + "!"}]
        assert item.ground_truth == row["reward_model"]["ground_truth"]
    assert "verl" not in sys.modules  # the answered imports are gone again


def test_a_class_with_its_own_items_reads_raw_prompt_and_drops_tensors(files, tiny_tokenizer):
    """verl's item layout: the messages as `raw_prompt` where the prompt column is absent; tensors are not read (a
    note says so); a constructor without max_samples is built without it."""
    folder, data = files
    dataset, source = rows_of(data, "OwnItems", folder / "classes.py", tiny_tokenizer)
    assert [it.ground_truth for it in dataset] == ["0", "2", "4", "6", "8"]
    assert dataset[3].raw_prompt == [{"role": "user", "content": "add 3 and 3"}]
    assert any("input_ids" in note and "not read" in note for note in dataset.notes)


def test_the_retool_recipe_class_asks_for_boxed_answers_and_the_tool_agent(files, tiny_tokenizer):
    folder, data = files
    dataset, _ = rows_of(data, "CustomRLHFDataset", RETOOL, tiny_tokenizer)
    assert all(it.agent_name == "tool_agent" for it in dataset)
    assert all(it.raw_prompt[0]["content"].endswith("\\boxed{'The final answer goes here.'}") for it in dataset)


def test_what_cannot_be_built_is_refused_at_load(files):
    folder, _ = files
    for keys, fragment in (
            ([f"data.custom_cls.path={folder / 'classes.py'}", "data.custom_cls.name=NotADataset"],
             "must be a class inheriting from torch.utils.data.Dataset"),
            ([f"data.custom_cls.path={folder / 'classes.py'}", "data.custom_cls.name=Missing"], "has no 'Missing'"),
            ([f"data.custom_cls.path={folder / 'nowhere.py'}", "data.custom_cls.name=X"], "no file"),
            ([f"data.custom_cls.path={folder / 'classes.py'}"], "name a dataset class together"),
            ([f"data.custom_cls.path={folder / 'needs_verl.py'}", "data.custom_cls.name=X"],
             "needs verl's own code: install verl")):
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, OK + keys)


def test_a_run_trains_on_the_class_s_rows(files, tiny_model_dir, tmp_path):
    """The dataset class is what the trainer reads: two GRPO steps on the tiny model over the ReTool class's rows."""
    sys.path.insert(0, str(ROOT / "tools"))
    from verl_examples import SMALL

    from posttrain.trainer.rl import run_rl

    folder, data = files
    small = [s.replace("STEPS", "2").replace("RUN_DIR", str(tmp_path / "run")) for s in SMALL]
    cfg = load_config(None, small + [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data}",
                                     "algorithm.adv_estimator=grpo", "data.train_max_samples=8",
                                     f"data.custom_cls.path={RETOOL}", "data.custom_cls.name=CustomRLHFDataset",
                                     f"custom_reward_function.path={RETOOL}"])
    run_rl(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
