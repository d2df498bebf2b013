"""Stateful tools with verl's interface, declared in verl's tool YAML (`multi_turn.tool_config_path`):

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool     # or posttrain's own, or a user's module.Class
        config: {type: native, ...}                     # passed to the class as `config`
        tool_schema: {type: function, function: {name, description, parameters}}   # optional: the class's default

One object per tool serves every episode; an episode's state lives under its instance id:
`create(instance_id, **create_kwargs)`, `execute(instance_id, parameters, **execute_kwargs) -> (response, reward,
metrics)`, `calc_reward(instance_id, **calc_reward_kwargs)`, `release(instance_id, **release_kwargs)`, sync or async.
The kwargs come from the row's `extra_info.tools_kwargs` = {tool_name: {"create_kwargs": {...}, "execute_kwargs":
..., "calc_reward_kwargs": ..., "release_kwargs": ...}}, as verl's data carries them (a `create` that takes **kwargs
or a `create_kwargs` parameter also gets them as `create_kwargs=`, as verl's agent loop passes them). The class
names of verl's
example configs load posttrain's built-ins (builtin/), which behave the same.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass

from .function import ToolLoadError

VERL_BUILTINS = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "posttrain.tools.builtin.gsm8k.Gsm8kTool",
    "verl.tools.geo3k_tool.Geo3kTool": "posttrain.tools.builtin.geo3k.Geo3kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "posttrain.tools.builtin.code.CodeInterpreterTool",
    "verl.tools.search_tool.SearchTool": "posttrain.tools.builtin.search.SearchTool",
}


@dataclass
class ToolResponse:
    """What verl's tools return as the response; any object with a `text` attribute is read the same way."""

    text: str | None = None


class BaseTool:
    """A stateful tool's defaults (verl's BaseTool without the async requirement): subclass and override."""

    default_schema: dict | None = None

    def __init__(self, config: dict, tool_schema: dict | None):
        self.config = config or {}
        self.tool_schema = tool_schema or self.default_schema
        if not self.tool_schema:
            raise ToolLoadError(f"{type(self).__name__} has no tool_schema: give one in the tool config")
        self.name = self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    def create(self, instance_id: str, **kwargs):
        return instance_id, ToolResponse()

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs) -> None:
        pass


def tool_class(class_name: str):
    """The class a config's `class_name` names: verl's built-in names map to posttrain's. A user's module imports with
    verl's tool interface answered where verl is not installed (verl_base.py, verl_sandbox.py), and is found in the
    current folder too, as `python -m verl.trainer.main_ppo` run there finds it (`recipe.retool.retool.<Class>`
    from a verl checkout)."""
    from ..data.verl_compat import verl_imports_answered

    path = VERL_BUILTINS.get(class_name, class_name)
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ToolLoadError(f"tool class_name {class_name!r} is not a module.Class path")
    try:
        with verl_imports_answered():
            return getattr(_import_here_too(module_name), attr)
    except (ImportError, AttributeError) as e:
        top = module_name.split(".")[0]
        hint = (f" (a module.Class path: run from the folder that holds `{top}`, or put that folder on PYTHONPATH)"
                if isinstance(e, ModuleNotFoundError) and e.name == top else "")
        raise ToolLoadError(f"tool class {class_name!r} cannot be loaded: {type(e).__name__}: {e}{hint}") from e


def _import_here_too(module_name: str):
    """`import module_name`; where its top package is not on sys.path but is in the current folder, the current
    folder joins sys.path (last) first."""
    top = module_name.split(".")[0]
    if importlib.util.find_spec(top) is None and (os.path.isdir(top) or os.path.isfile(top + ".py")):
        sys.path.append(os.getcwd())
    return importlib.import_module(module_name)


def load_tool_config(path: str) -> list:
    """The tool objects a verl tool YAML declares."""
    from omegaconf import OmegaConf

    if not os.path.isfile(os.path.expanduser(path)):
        raise ToolLoadError(f"multi_turn.tool_config_path: no file at {path}")
    data = OmegaConf.to_container(OmegaConf.load(os.path.expanduser(path)), resolve=True) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ToolLoadError(f"{path}: expected a top-level `tools:` list of {{class_name, config, tool_schema}}")
    tools = []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or not entry.get("class_name"):
            raise ToolLoadError(f"{where} has no class_name")
        config = dict(entry.get("config") or {})
        corpus = config.get("corpus_path")
        if isinstance(corpus, str) and not os.path.isabs(os.path.expanduser(corpus)):  # beside the YAML, wherever run
            config["corpus_path"] = os.path.join(os.path.dirname(os.path.abspath(os.path.expanduser(path))), corpus)
        kind = config.get("type", "native")
        if kind != "native":
            raise ToolLoadError(f"{where}: tool type {kind!r} is not supported (only native tools)")
        schema = entry.get("tool_schema")
        if schema is not None and not isinstance((schema.get("function") or {}).get("name"), str):
            raise ToolLoadError(f"{where}: tool_schema needs function.name")
        try:
            tools.append(tool_class(entry["class_name"])(config=config, tool_schema=schema))
        except Exception as e:  # a constructor's own check (a missing corpus, a bad setting) names the entry
            raise ToolLoadError(f"{where} ({entry['class_name']}): {e}") from e
    return tools
