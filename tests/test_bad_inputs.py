"""Every bad input gets one clear message: the CLI prints it without a traceback and exits 2; library callers get a
ConfigError or DataError. Each case here is a row of the "Bad inputs" table in docs/reliability.md."""

import json
import shutil
import subprocess
import sys

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError, load_config
from posttrain.data.dataset import DataError, RLDataset
from posttrain.data.synthetic import rl_row

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def good_rows(n=8):
    return [rl_row(a, a + 1, "train", a) for a in range(n)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_dir):
    """A good data file, the tiny model, and the bad files the cases below name."""
    d = tmp_path_factory.mktemp("bad_inputs")
    f = {"model": tiny_model_dir, "data": write_rows(d / "good.jsonl", good_rows()), "dir": d}

    def rows_with(name, change):
        rows = good_rows()
        change(rows[3])
        f[name] = write_rows(d / f"{name}.jsonl", rows)

    rows_with("empty_prompt", lambda r: r.update(prompt=""))
    rows_with("blank_messages", lambda r: r.update(prompt=[{"role": "system", "content": ""},
                                                            {"role": "user", "content": "  "}]))
    rows_with("null_content", lambda r: r.update(prompt=[{"role": "user", "content": None}]))
    rows_with("list_content", lambda r: r.update(prompt=[{"role": "user", "content": [{"type": "text"}]}]))
    rows_with("no_content_key", lambda r: r.update(prompt=[{"role": "user", "text": "1+2="}]))
    rows_with("prompt_int", lambda r: r.update(prompt=7))
    rows_with("extra_info_str", lambda r: r.update(extra_info="split=train"))
    rows_with("data_source_null", lambda r: r.update(data_source=None))
    rows_with("unknown_source", lambda r: r.update(data_source="my/own_task"))
    rows_with("no_ground_truth", lambda r: r.update(reward_model={"style": "rule"}))
    rows_with("images", lambda r: r.update(images=["a.png"]))
    rows_with("no_prompt_column", lambda r: r.update(question=r.pop("prompt")))
    f["not_utf8"] = d / "latin1.jsonl"
    f["not_utf8"].write_bytes(f["data"].read_bytes() + json.dumps(rl_row(1, 2, "train", 9)).replace(
        "1+2=", "caf\\u00e9").encode().replace(b"\\u00e9", b"\xe9") + b"\n")
    f["bad_json"] = d / "bad_json.jsonl"
    f["bad_json"].write_text(f["data"].read_text() + "{not json\n")
    f["bad_parquet"] = d / "bad.parquet"
    f["bad_parquet"].write_text("not parquet")
    f["csv"] = d / "rows.csv"
    f["csv"].write_text("prompt,answer\n1+2=,3\n")
    f["empty"] = d / "empty.jsonl"
    f["empty"].write_text("\n")
    f["yaml_syntax"] = d / "syntax.yaml"
    f["yaml_syntax"].write_text("data:\n  train_batch_size: [8\ntrainer:\n  seed: 1\n")
    f["yaml_tab"] = d / "tab.yaml"
    f["yaml_tab"].write_text("data:\n\ttrain_batch_size: 8\n")
    f["yaml_latin1"] = d / "latin1.yaml"
    f["yaml_latin1"].write_bytes(b"trainer:\n  experiment_name: caf\xe9\n")
    f["yaml_list"] = d / "list.yaml"
    f["yaml_list"].write_text("- data.train_batch_size=8\n")
    rewards = {"reward_syntax": "def compute_score(data_source, solution_str:\n    return 1.0\n",
               "reward_no_fn": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
               "reward_signature": "def compute_score(solution_str, ground_truth):\n    return 1.0\n",
               "reward_kwonly": "def compute_score(data_source, solution_str, ground_truth, extra_info, *, k):\n"
                                "    return 1.0\n",
               "reward_import": "import not_a_module_anywhere_xyz\n\n"
                                "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                "    return 1.0\n",
               "reward_async": "async def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                               "    return 1.0\n",
               "reward_raises": "import os\n\nKEY = os.environ['NO_SUCH_VARIABLE_XYZ']\n\n"
                                "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                "    return 1.0\n",
               "reward_good": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                              "    return 1.0\n"}
    for name, text in rewards.items():
        f[name] = d / f"{name}.py"
        f[name].write_text(text)
    notemplate = d / "no_template_model"
    shutil.copytree(tiny_model_dir, notemplate)
    (notemplate / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((notemplate / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (notemplate / "tokenizer_config.json").write_text(json.dumps(config))
    f["no_template_model"] = notemplate
    f["not_a_model"] = d / "notes"  # a folder, but of other files
    f["not_a_model"].mkdir()
    (f["not_a_model"] / "README.md").write_text("notes\n")
    return f


def train_args(f, *extra, data=None):
    return ["train", "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=32",
            "data.max_response_length=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            f"actor_rollout_ref.model.path={f['model']}", f"data.train_files={data or f['data']}",
            "trainer.total_training_steps=1", "trainer.logger=['jsonl']", "trainer.val_before_train=False",
            f"trainer.default_local_dir={f['dir'] / 'run'}", *extra]


def sft_args(f, *extra, data=None):
    return ["sft", "--model", str(f["model"]), "--train-files", str(data or f["data"]),
            "--output-dir", str(f["dir"] / "sft"), "--prompt-key", "prompt", "--response-key", "ability", *extra]


# (id, argv builder, a fragment of the one message)
CLI_CASES = [
    # ---- config: files, YAML, keys and values
    ("missing_data_file", lambda f: train_args(f, data="/nope/train.jsonl"),
     "data.train_files: '/nope/train.jsonl' does not exist"),
    ("missing_val_file", lambda f: train_args(f, "data.val_files=/nope/val.parquet"),
     "data.val_files: '/nope/val.parquet' does not exist"),
    ("model_path_missing", lambda f: train_args(f, "actor_rollout_ref.model.path=/nope"),
     "actor_rollout_ref.model.path='/nope' is not a local directory"),
    ("model_path_is_a_file", lambda f: train_args(f, f"actor_rollout_ref.model.path={f['data']}"),
     "is a file; give a model directory"),
    ("model_path_not_a_model", lambda f: train_args(f, f"actor_rollout_ref.model.path={f['not_a_model']}"),
     "is a folder but not a model: it has no config.json, no weights (*.safetensors, *.bin) and no tokenizer files"),
    ("config_file_missing", lambda f: ["train", "--config", "/nope/run.yaml"], "config file '/nope/run.yaml' not found"),
    ("yaml_syntax_error", lambda f: ["train", "--config", str(f["yaml_syntax"])],
     "is not valid YAML at line 3, column 8: expected ',' or ']', but got ':' (while parsing a flow sequence at line 2)"),
    ("yaml_tab_indent", lambda f: ["train", "--config", str(f["yaml_tab"])],
     "is not valid YAML at line 2, column 1: found character '\\t' that cannot start any token"),
    ("yaml_not_utf8", lambda f: ["train", "--config", str(f["yaml_latin1"])], "is not UTF-8 text: byte 31 (line 2)"),
    ("yaml_not_a_mapping", lambda f: ["train", "--config", str(f["yaml_list"])], "must hold a mapping"),
    ("unknown_key_typo", lambda f: train_args(f, "trainer.total_epoch=2"), "Did you mean 'trainer.total_epochs'?"),
    ("wrong_type", lambda f: train_args(f, "data.train_batch_size=eight"), "expects int, got 'eight'"),
    ("override_without_equals", lambda f: train_args(f, "trainer.seed"), "is not of the form key=value"),
    ("grad_clip_negative", lambda f: train_args(f, "actor_rollout_ref.actor.grad_clip=-1"),
     "actor_rollout_ref.actor.grad_clip=-1.0 must be positive"),
    ("critic_grad_clip_zero", lambda f: train_args(f, "critic.grad_clip=0"), "critic.grad_clip=0.0 must be positive"),
    ("total_training_steps_negative", lambda f: train_args(f, "trainer.total_training_steps=-5"),
     "trainer.total_training_steps=-5 must be >= 1"),
    ("total_training_steps_zero", lambda f: train_args(f, "trainer.total_training_steps=0"),
     "trainer.total_training_steps=0 must be >= 1"),
    ("train_batch_size_zero", lambda f: train_args(f, "data.train_batch_size=0"),
     "data.train_batch_size must be positive"),
    ("mini_batch_not_dividing", lambda f: train_args(f, "actor_rollout_ref.actor.ppo_mini_batch_size=3"),
     "must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size (3)"),
    ("rollout_n_zero", lambda f: train_args(f, "actor_rollout_ref.rollout.n=0"), "rollout.n >= 2"),
    ("val_batch_size_negative", lambda f: train_args(f, "data.val_batch_size=-2"),
     "data.val_batch_size=-2 must be positive"),
    ("train_max_samples_zero", lambda f: train_args(f, "data.train_max_samples=0"),
     "data.train_max_samples=0 must be >= 1 (or -1: every row)"),
    ("lr_negative", lambda f: train_args(f, "actor_rollout_ref.actor.optim.lr=-1e-6"),
     "actor_rollout_ref.actor.optim.lr must be >= 0"),
    ("logger_unknown", lambda f: train_args(f, "trainer.logger=[jsonl,neptune]"), "'neptune' is not one of"),
    ("missing_chat_template_value", lambda f: train_args(f, "data.missing_chat_template=guess"),
     "data.missing_chat_template='guess' is not one of ['error', 'join']"),
    ("max_nonfinite_negative", lambda f: train_args(f, "trainer.max_nonfinite_updates_in_a_row=-1"),
     "trainer.max_nonfinite_updates_in_a_row must be >= 0"),
    ("parquet_unreadable", lambda f: train_args(f, data=f["bad_parquet"]), "bad.parquet: not a readable parquet file"),
    # ---- custom reward function file
    ("reward_file_missing", lambda f: train_args(f, "custom_reward_function.path=/nope/reward.py"),
     "custom_reward_function.path: '/nope/reward.py' does not exist"),
    ("reward_syntax_error", lambda f: train_args(f, f"custom_reward_function.path={f['reward_syntax']}"),
     "has a syntax error at line 1"),
    ("reward_function_missing", lambda f: train_args(f, f"custom_reward_function.path={f['reward_no_fn']}"),
     "defines no function 'compute_score' (functions defined there: ['score'])"),
    ("reward_wrong_signature", lambda f: train_args(f, f"custom_reward_function.path={f['reward_signature']}"),
     "compute_score(solution_str, ground_truth) cannot be called as compute_score(data_source, solution_str, "
     "ground_truth, extra_info)"),
    ("reward_required_keyword", lambda f: train_args(f, f"custom_reward_function.path={f['reward_kwonly']}"),
     "cannot be called as compute_score("),
    ("reward_async", lambda f: train_args(f, f"custom_reward_function.path={f['reward_async']}"),
     "is an async function"),
    ("reward_import_missing", lambda f: train_args(f, f"custom_reward_function.path={f['reward_import']}"),
     "imports 'not_a_module_anywhere_xyz', which is not installed"),
    # ---- sft command line
    ("sft_batch_size_negative", lambda f: sft_args(f, "--batch-size", "-3"), "--batch-size=-3 must be a whole number > 0"),
    ("sft_batch_size_zero", lambda f: sft_args(f, "--batch-size", "0"), "--batch-size=0 must be a whole number > 0"),
    ("sft_epochs_zero", lambda f: sft_args(f, "--epochs", "0"), "--epochs=0.0 must be > 0"),
    ("sft_lr_negative", lambda f: sft_args(f, "--lr", "-0.1"), "--lr=-0.1 must be >= 0"),
    ("sft_max_length_zero", lambda f: sft_args(f, "--max-length", "0"), "--max-length=0 must be a whole number > 0"),
    ("sft_eval_every_zero", lambda f: sft_args(f, "--eval-every", "0"), "--eval-every=0 must be a whole number > 0"),
    ("sft_train_file_missing", lambda f: sft_args(f, data="/nope/sft.jsonl"),
     "--train-files: '/nope/sft.jsonl' does not exist"),
    ("sft_model_missing", lambda f: sft_args(f)[:2] + ["/nope"] + sft_args(f)[3:], "--model='/nope' is not a local"),
    ("sft_model_not_a_model", lambda f: sft_args(f)[:2] + [str(f["not_a_model"])] + sft_args(f)[3:],
     "is a folder but not a model: it has no config.json"),
    # ---- data rows (found after the tokenizer loads, before any model)
    ("prompt_empty_string", lambda f: train_args(f, data=f["empty_prompt"]),
     "empty_prompt.jsonl: row 3, column 'prompt': the prompt is empty"),
    ("prompt_blank_messages", lambda f: train_args(f, data=f["blank_messages"]),
     "blank_messages.jsonl: row 3, column 'prompt': the prompt is empty"),
    ("message_content_null", lambda f: train_args(f, data=f["null_content"]),
     "null_content.jsonl: row 3, column 'prompt', message 0: 'content' is null"),
    ("message_content_list", lambda f: train_args(f, data=f["list_content"]),
     "list_content.jsonl: row 3, column 'prompt', message 0: 'content' is a list"),
    ("message_without_content", lambda f: train_args(f, data=f["no_content_key"]),
     "no_content_key.jsonl: row 3, column 'prompt', message 0: no 'content' key"),
    ("prompt_wrong_type", lambda f: train_args(f, data=f["prompt_int"]),
     "prompt_int.jsonl: row 3, column 'prompt': expected a list of chat messages"),
    ("extra_info_string", lambda f: train_args(f, data=f["extra_info_str"]),
     "extra_info_str.jsonl: row 3, column 'extra_info': expected a struct (a JSON object) or null, got str"),
    ("data_source_null", lambda f: train_args(f, data=f["data_source_null"]),
     "data_source_null.jsonl: row 3, column 'data_source': expected the name of the data source"),
    ("ground_truth_missing", lambda f: train_args(f, data=f["no_ground_truth"]),
     "no_ground_truth.jsonl: row 3: column 'reward_model' must be a struct with 'ground_truth'"),
    ("images_column", lambda f: train_args(f, data=f["images"]), "images.jsonl: row 3: column 'images' holds images"),
    ("prompt_column_missing", lambda f: train_args(f, data=f["no_prompt_column"]),
     "row 3: missing column 'prompt' (columns: ['ability', 'data_source', 'extra_info', 'question', 'reward_model']); "
     "if it is in another column, set data.prompt_key"),
    ("jsonl_not_utf8", lambda f: train_args(f, data=f["not_utf8"]), "latin1.jsonl: line 9 is not UTF-8: byte"),
    ("jsonl_bad_json", lambda f: train_args(f, data=f["bad_json"]), "bad_json.jsonl: row 8 (line 9) is not valid JSON"),
    ("unsupported_file_type", lambda f: train_args(f, data=f["csv"]), "unsupported file type '.csv'"),
    ("data_file_empty", lambda f: train_args(f, data=f["empty"]), "no rows (the files are empty)"),
    ("filter_overlong_drops_all", lambda f: train_args(f, "data.max_prompt_length=3", "data.filter_overlong_prompts=True"),
     "data.filter_overlong_prompts dropped all 8 rows"),
    ("prompt_too_long", lambda f: train_args(f, "data.max_prompt_length=3"),
     "tokens > data.max_prompt_length=3; raise the limit"),
    ("fewer_rows_than_batch", lambda f: train_args(f, "data.train_batch_size=16",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=16"),
     "data.train_batch_size=16 is larger than the training set (8 prompts)"),
    ("no_chat_template", lambda f: train_args(f, f"actor_rollout_ref.model.path={f['no_template_model']}"),
     "has no chat template; give a tokenizer that has one (chat_template.jinja in its folder), or set "
     "data.missing_chat_template=join"),
    ("sft_prompt_null_content", lambda f: sft_args(f, data=f["null_content"]),
     "null_content.jsonl: row 3, column 'prompt', message 0: 'content' is null"),
    ("sft_response_column_missing", lambda f: sft_args(f, "--response-key", "answer"),
     "missing column 'answer'"),
    # ---- other commands
    ("export_missing_checkpoint", lambda f: ["export", "/nope/global_step_1", str(f["dir"] / "hf")],
     "/nope/global_step_1 is not a posttrain checkpoint"),
    ("prepare_missing_input", lambda f: ["prepare", "gsm8k", "--input", "/nope/gsm8k", "--output-dir",
                                         str(f["dir"] / "prep")], "/nope/gsm8k"),
]


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input(files, capsys, argv, fragment):
    """One message naming the problem, exit code 2, no traceback (main() in-process: no subprocess start)."""
    assert main(argv(files)) == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    assert "Traceback" not in err
    assert err.count("error:") == 1, err


@pytest.fixture
def no_model_loads(monkeypatch):
    """Loading the models fails the test: what it checks must be reported before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the models were loaded before the problem was reported")
    monkeypatch.setattr("posttrain.trainer.setup.Roles", refuse)


def test_unknown_data_source(files, capsys, no_model_loads):
    """The scorers are known from the registry and the reward file: one message, exit code 2, no model loaded."""
    assert main(train_args(files, data=files["unknown_source"])) == 2
    err = capsys.readouterr().err
    assert "no reward function for data_source 'my/own_task'" in err and "Traceback" not in err


def test_reward_file_that_fails_while_imported(files, capsys, no_model_loads):
    """Its text is fine; running it raises (a missing environment variable): named with its line, exit 2, before
    any model loads."""
    assert main(train_args(files, f"custom_reward_function.path={files['reward_raises']}")) == 2
    err = capsys.readouterr().err
    assert "custom_reward_function.path: importing" in err and "failed at line 3: KeyError" in err, err
    assert "NO_SUCH_VARIABLE_XYZ" in err and "Traceback" not in err


def test_cuda_asked_for_without_cuda(files, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(train_args(files, "trainer.device=cuda")) == 2
    err = capsys.readouterr().err
    assert "config error: trainer.device=cuda but no CUDA device is available" in err and "Traceback" not in err


def test_logger_package_missing(files, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert main(train_args(files, "trainer.logger=[jsonl,mlflow]")) == 2
    assert "trainer.logger names mlflow, which is not installed: pip install 'posttrain[tracking]'" in \
        capsys.readouterr().err


def test_wandb_without_login(files, monkeypatch, tmp_path):
    """wandb.init's own error (no API key) becomes a ConfigError naming the logger and the ways to log in."""
    wandb = pytest.importorskip("wandb")
    from posttrain.trainer.tracking import Tracker

    def refuse(**kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(ConfigError, match="trainer.logger=wandb: wandb could not start .*No API key.*WANDB_API_KEY"):
        Tracker(["wandb"], tmp_path, 1)


# ------------------------------------------------------------------ what library callers get


def test_library_callers_get_typed_errors(files, tiny_tokenizer):
    with pytest.raises(ConfigError, match="grad_clip=-1.0 must be positive"):
        load_config(None, ["actor_rollout_ref.actor.grad_clip=-1"])
    with pytest.raises(ConfigError, match="syntax error at line 1"):
        load_config(None, [f"custom_reward_function.path={files['reward_syntax']}"])
    with pytest.raises(DataError, match="message 0: 'content' is null"):
        RLDataset(str(files["null_content"]), tiny_tokenizer)
    with pytest.raises(DataError, match="has no chat template"):
        from posttrain.models.load import load_tokenizer

        RLDataset(str(files["data"]), load_tokenizer(str(files["no_template_model"])))
    from posttrain.trainer.sft import SFTArgs, run_sft

    with pytest.raises(ConfigError, match="--batch-size=-3"):
        run_sft(SFTArgs(model_path=str(files["model"]), train_files=[str(files["data"])], output_dir="unused",
                        batch_size=-3))
    assert load_config(None, [f"custom_reward_function.path={files['reward_good']}"])  # a good file passes


# ------------------------------------------------------------------ accepted, with a note or a documented rule


def test_ground_truth_float_is_read_as_integer_and_null_is_noted(files, tiny_tokenizer, tmp_path):
    rows = good_rows()
    rows[1]["reward_model"]["ground_truth"] = 85.0
    rows[2]["reward_model"]["ground_truth"] = 2.5
    rows[4]["reward_model"]["ground_truth"] = None
    rows[5]["reward_model"]["ground_truth"] = ""
    data = RLDataset(str(write_rows(tmp_path / "truths.jsonl", rows)), tiny_tokenizer)
    truths = [it.ground_truth for it in data.items]
    assert truths[1] == 85 and isinstance(truths[1], int) and truths[2] == 2.5 and truths[4] is None
    assert truths[0] == "1"  # strings stay strings
    assert data.notes == [
        f"1 row has a whole-number float ground_truth such as 85.0: read as the integer (85), which the rule scorers "
        f"compare as '85' (first: {tmp_path / 'truths.jsonl'}: row 1)",
        f"2 rows have a null or empty ground_truth: the rule scorers give their responses 0 (first: "
        f"{tmp_path / 'truths.jsonl'}: row 4)"]
    from posttrain.reward.gsm8k import compute_score

    assert compute_score("#### 85", truths[1]) == 1.0  # as the string "85" would


def test_filter_overlong_prompts_reports_what_it_dropped(files, tiny_tokenizer, tmp_path):
    rows = good_rows(6)
    rows[2]["prompt"][0]["content"] = "1+2=" * 30
    data = RLDataset(str(write_rows(tmp_path / "long.jsonl", rows)), tiny_tokenizer, max_prompt_length=40,
                     filter_overlong_prompts=True)
    assert len(data) == 5 and data.num_filtered == 1
    assert data.notes[0].startswith("data.filter_overlong_prompts dropped 1 of 6 rows of")


def test_notes_are_printed_by_the_trainer(files, capsys, tmp_path):
    rows = good_rows()
    rows[0]["reward_model"]["ground_truth"] = 1.0
    data = write_rows(tmp_path / "float_truth.jsonl", rows)
    assert main(train_args(files, "trainer.total_training_steps=1", data=data)) == 0
    assert "note: 1 row has a whole-number float ground_truth" in capsys.readouterr().err


def test_missing_chat_template_join_is_the_explicit_fallback(files):
    from posttrain.models.load import load_tokenizer

    tok = load_tokenizer(str(files["no_template_model"]))
    data = RLDataset(str(files["data"]), tok, missing_chat_template="join")
    assert data.items[0].prompt_ids == tok("0+1=", add_special_tokens=True)["input_ids"]


# ------------------------------------------------------------------ the real command line, a few cases


@pytest.mark.parametrize("case", ["missing_data_file", "yaml_syntax_error", "message_content_null"])
def test_cli_subprocess_exit_code_2(files, case):
    argv = dict((c[0], c[1]) for c in CLI_CASES)[case](files)
    fragment = dict((c[0], c[2]) for c in CLI_CASES)[case]
    done = subprocess.run([sys.executable, "-m", "posttrain", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert fragment in done.stderr and "Traceback" not in done.stderr


def test_reward_file_check_accepts_working_files(tmp_path):
    """The check parses without running: what it cannot see (assigned or imported names, a class, a sibling module,
    an import inside try) is left to the loader rather than refused."""
    from posttrain.config.reward_file import reward_file_problem

    (tmp_path / "helpers.py").write_text("def score(*a):\n    return 1.0\n")
    cases = {
        "sibling.py": "import sys, os\nsys.path.insert(0, os.path.dirname(__file__))\nimport helpers\n"
                      "compute_score = helpers.score\n",
        "optional.py": "try:\n    import not_a_module_anywhere_xyz\nexcept ImportError:\n    pass\n"
                       "def compute_score(*args):\n    return 0.0\n",
        "callable_class.py": "class compute_score:\n    def __call__(self, a, b, c, d):\n        return 0.0\n",
        "defaults.py": "def compute_score(data_source, solution_str, ground_truth=None, extra_info=None, k=3, **kw):\n"
                       "    return 0.0\n",
        "positional_only.py": "def compute_score(a, b, c, d, /):\n    return 0.0\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert reward_file_problem(str(tmp_path / name), "compute_score") is None, name
    (tmp_path / "five.py").write_text("def compute_score(a, b, c, d, e):\n    return 0.0\n")
    assert "cannot be called as" in reward_file_problem(str(tmp_path / "five.py"), "compute_score")
