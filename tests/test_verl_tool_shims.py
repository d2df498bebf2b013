"""Tool classes written against verl's tool interface, where verl is not installed: `verl.tools.base_tool`,
`verl.tools.schemas`, `verl.utils.rollout_trace` and `verl.tools.sandbox_fusion_tools` answer while the tool's module
loads (posttrain/data/verl_compat.py), so the ReTool recipe's CustomSandboxFusionTool loads from its YAML unchanged
and runs its code in posttrain's sandbox, hostile code contained as the code interpreter's is."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import yaml

from posttrain.config import ConfigError, load_config
from posttrain.reward import code as code_reward
from posttrain.reward import sandbox
from posttrain.tools import ToolBox, ToolLoadError, parse_tool_calls

ROOT = Path(__file__).resolve().parents[1]
RETOOL = ROOT / "tests" / "data" / "multiturn_scripts_2026_04" / "recipe_retool"
needs_sandbox = pytest.mark.skipif(not sandbox.sandbox_status()[0], reason="no bubblewrap sandbox on this machine")

USER_TOOLS = '''
from verl.tools.base_tool import BaseTool
from verl.tools.sandbox_fusion_tools import SandboxFusionTool
from verl.tools.schemas import ToolResponse
from verl.utils.rollout_trace import rollout_trace_op


class Twice(SandboxFusionTool):
    """Runs the code twice through verl's execution pool, with and without a timeout and language."""

    @rollout_trace_op
    async def execute(self, instance_id, parameters, **kwargs):
        pool = self.execution_pool.execute
        first = await pool.remote(self.execute_code, instance_id, parameters["code"], 5, "python")
        second = await pool.remote(self.execute_code, instance_id, parameters["code"])
        return ToolResponse(text=first.text + second.text), 0.5, {"runs": 2}


class Failing(SandboxFusionTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return await self.execution_pool.execute.remote(lambda: 1 / 0), None, None


class Named(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=self.tool_schema.function.name), 0.0, {}


class Pictures(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="see", image=["a picture"]), 0.0, {}
'''


def schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "description": "Python code"}},
        "required": ["code"]}}}


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """The current folder as a verl checkout with the ReTool recipe (the stand-in) in recipe/retool and a user's
    tool module; sys.path and the modules imported from there are restored after."""
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "retool").symlink_to(RETOOL, target_is_directory=True)
    (tmp_path / "user_verl_tools.py").write_text(USER_TOOLS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith(("recipe", "user_verl_tools"))]:
        del sys.modules[name]


def recipe_yaml(folder: Path, **config) -> str:
    """The recipe's tool YAML, its config changed by `config`."""
    data = yaml.safe_load((RETOOL / "sandbox_fusion_tool_config.yaml").read_text())
    data["tools"][0]["config"].update(config)
    (folder / "tools.yaml").write_text(json.dumps(data))
    return str(folder / "tools.yaml")


def user_yaml(folder: Path, *entries) -> str:
    (folder / "user.yaml").write_text(json.dumps({"tools": [
        {"class_name": f"user_verl_tools.{cls}", "config": {"type": "native", **config}, "tool_schema": schema(name)}
        for cls, name, config in entries]}))
    return str(folder / "user.yaml")


def run_one(box: ToolBox, name: str, arguments: dict):
    session = box.open({})
    text = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    (result,) = session.run(parse_tool_calls(text).calls)
    session.close()
    return result


@needs_sandbox
def test_the_recipes_tool_class_loads_from_its_yaml_and_runs_code_in_the_sandbox(checkout):
    """The recipe's YAML names `recipe.retool.retool.CustomSandboxFusionTool` (found from the checkout, as `python -m
    verl.trainer.main_ppo` run there finds it); with an empty `sandbox_fusion_url` its code runs in this process's
    sandbox. It keeps verl's schema object, the YAML's schema reaches the chat template, and no `verl` module is
    left behind."""
    box = ToolBox.from_settings(tool_config_path=recipe_yaml(checkout, sandbox_fusion_url=""))
    tool = box.tools["code_interpreter"]
    assert [c.__name__ for c in type(tool).__mro__[:3]] == ["CustomSandboxFusionTool", "SandboxFusionTool", "BaseTool"]
    assert tool.tool_schema.function.name == "code_interpreter" and tool.default_timeout == 30
    assert box.schemas() == [yaml.safe_load((RETOOL / "sandbox_fusion_tool_config.yaml").read_text())[
        "tools"][0]["tool_schema"]]
    assert not [name for name in sys.modules if name == "verl" or name.startswith("verl.")]
    fenced = "Let me compute.\n```python\nimport math\nmath.factorial(5)\n```"
    result = run_one(box, "code_interpreter", {"code": fenced})
    assert (result.message["content"], result.error) == ("120\n", None)  # out of the fence, its last line printed
    response, reward, metrics = asyncio.run(tool.execute("i", {"code": "print('a')\nprint('b')"}))
    assert (response.text, reward, metrics) == ("a\nb\n", None, None)


@needs_sandbox
def test_a_subclass_uses_verls_pool_and_methods(checkout):
    """`execution_pool.execute.remote(fn, *args)` is an awaitable of fn(*args); `execute_code`'s defaults are verl's;
    a subclass's reward and metrics are read; a failing call is a counted `tool_raised` (verl's pool logs it and
    answers nothing); a response with an image is a `bad_return` (answers reach the model as text only)."""
    box = ToolBox.from_settings(tool_config_path=user_yaml(checkout, ("Twice", "twice", {"default_timeout": 5}),
                                                           ("Failing", "failing", {}), ("Named", "named", {}),
                                                           ("Pictures", "pictures", {})))
    result = run_one(box, "twice", {"code": "print(2 + 2)"})
    assert (result.message["content"], result.error, result.reward, result.metrics) == ("4\n4\n", None, 0.5,
                                                                                        {"runs": 2})
    assert run_one(box, "failing", {"code": ""}).error == "tool_raised"
    assert "ZeroDivisionError" in run_one(box, "failing", {"code": ""}).message["content"]
    assert run_one(box, "named", {"code": ""}).message["content"] == "named"
    pictures = run_one(box, "pictures", {"code": ""})
    assert pictures.error == "bad_return" and "images or video" in pictures.message["content"]
    session = box.open({"twice": {"create_kwargs": {"ground_truth": "4"}}})
    assert session.reward() == 0.0 and session.take_errors() == {}  # verl's calc_reward list, as a number


def test_bad_settings_and_a_missing_module_are_named(checkout):
    """Settings verl's class reads are checked; a schema verl's model refuses is refused; a tool module that cannot
    be found says where it is looked for; a config naming tool code that does not import is refused at load."""
    for config, named in [({"num_workers": 0}, "config.num_workers"), ({"memory_limit_mb": "lots"},
                                                                       "config.memory_limit_mb"),
                          ({"default_timeout": -1}, "config.default_timeout")]:
        with pytest.raises(ToolLoadError, match=named):
            ToolBox.from_settings(tool_config_path=recipe_yaml(checkout, **config))
    bad = {"tools": [{"class_name": "recipe.retool.retool.CustomSandboxFusionTool", "config": {"type": "native"},
                      "tool_schema": {"type": "function", "function": {"name": "x"}}}]}  # verl's schema: no description
    (checkout / "bad.yaml").write_text(json.dumps(bad))
    with pytest.raises(ToolLoadError, match="description"):
        ToolBox.from_settings(tool_config_path=str(checkout / "bad.yaml"))
    (checkout / "missing.yaml").write_text(json.dumps({"tools": [{"class_name": "nowhere_pkg.tools.Tool",
                                                                  "config": {"type": "native"}}]}))
    with pytest.raises(ToolLoadError, match="No module named 'nowhere_pkg'.*run from the folder that holds"):
        ToolBox.from_settings(tool_config_path=str(checkout / "missing.yaml"))
    ok = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
          "actor_rollout_ref.rollout.multi_turn.enable=True",
          f"actor_rollout_ref.rollout.multi_turn.tool_config_path={checkout / 'missing.yaml'}"]
    with pytest.raises(ConfigError, match=r"tool_config_path: .*missing.yaml: tools\[0\]: tool class "
                                          "'nowhere_pkg.tools.Tool' cannot be loaded"):
        load_config(None, ok)  # at load, not when the run starts
    (checkout / "functions.py").write_text("import nowhere_pkg\n")
    with pytest.raises(ConfigError, match="function_tool_path: .*functions.py failed to load: ModuleNotFoundError"):
        load_config(None, ok[:3] + [f"actor_rollout_ref.rollout.multi_turn.function_tool_path="
                                    f"{checkout / 'functions.py'}"])


def test_verl_names_answer_only_while_a_users_module_loads():
    from posttrain.data.verl_compat import supplied, verl_imports_answered

    assert supplied("verl.tools") and supplied("verl.tools.sandbox_fusion_tools") and not supplied("verl.trainer")
    with verl_imports_answered():
        from verl.tools.base_tool import OpenAIFunctionToolSchema
        from verl.tools.sandbox_fusion_tools import SandboxFusionTool
        from verl.utils.dataset.rl_dataset import RLHFDataset
        with verl_imports_answered():  # nested: the outer one cleans up
            from verl.tools.function_tool import function_tool
        import verl.tools.schemas as schemas

        assert schemas.OpenAIFunctionToolSchema is OpenAIFunctionToolSchema and callable(function_tool)
        assert SandboxFusionTool.__module__ == "posttrain.tools.verl_sandbox" and RLHFDataset
        with pytest.raises(ImportError):
            import verl.trainer.main_ppo  # noqa: F401 - not answered
    assert not [name for name in sys.modules if name == "verl" or name.startswith("verl.")]
    with pytest.raises(ImportError):
        import verl.tools.schemas  # noqa: F401,F811


# ---------------------------------------------------------------- hostile code, as the code interpreter's tests


@pytest.fixture
def recipe_tool(checkout, tmp_path_factory, monkeypatch):
    """The recipe's tool on the local sandbox (empty URL), default_timeout 2 s, 256 MB; then the current folder is
    a run folder and HOME a home folder, each holding a secret, as in test_sandbox.py."""
    box = ToolBox.from_settings(tool_config_path=recipe_yaml(checkout, sandbox_fusion_url="", default_timeout=2,
                                                             memory_limit_mb=256))
    run, home = tmp_path_factory.mktemp("run"), tmp_path_factory.mktemp("home")
    for folder in (run, home):
        (folder / "secret.txt").write_text("s3cret-run-value")
    monkeypatch.chdir(run)
    monkeypatch.setenv("HOME", str(home))
    return box, run, home


@needs_sandbox
def test_a_fork_bomb_is_contained(recipe_tool):
    from test_sandbox import alive_with, leftover_cgroups

    box, _, _ = recipe_tool
    bomb = ("```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
            "        pass\nos.getpid()\n```")  # the recipe prints the last line
    result = run_one(box, "code_interpreter", {"code": bomb})
    assert result.error is None and "(execution stopped:" in result.message["content"]
    assert "process limit" in result.message["content"]
    assert not alive_with("/tmp/.posttrain/main.py") and not leftover_cgroups()


@needs_sandbox
def test_an_endless_loop_stops_at_default_timeout_whatever_it_asks(recipe_tool):
    box, _, _ = recipe_tool
    result = run_one(box, "code_interpreter", {"code": "while True:\n    pass\n0", "timeout": 1e9})
    # stopped by the sandbox at default_timeout (2 s), not abandoned at the call's limit (30 s: error "timeout")
    assert "(execution stopped: TimeLimitExceeded" in result.message["content"] and result.error is None


@needs_sandbox
def test_files_outside_stay_unread_and_unwritten(recipe_tool, monkeypatch, tmp_path_factory):
    """The run folder (the current one), the home folder, and a folder the run's code settings hide (the run's data
    folders) are unreadable; writes outside the sandbox's /tmp reach nothing."""
    box, run, home = recipe_tool
    data = tmp_path_factory.mktemp("data")
    (data / "answers.txt").write_text("s3cret-run-value")
    monkeypatch.setattr(code_reward, "_settings", code_reward.CodeSettings(hide=(str(data),)))
    paths = [str(run / "secret.txt"), str(home / "secret.txt"), str(data / "answers.txt")]
    program = ("found = []\nfor p in %r:\n    try:\n        found.append(open(p).read())\n    except OSError:\n"
               "        pass\nfor p in %r:\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n"
               "        pass\nlen(found)") % (paths, [str(run / "pwned"), str(home / "pwned"), str(data / "pwned")])
    result = run_one(box, "code_interpreter", {"code": program})
    assert result.message["content"] == "0\n"
    assert not any(Path(p).with_name("pwned").exists() for p in paths)
