"""Checks of what a config asks posttrain to load from the user besides models, data and rewards, made when the config
loads: a chat template that replaces the tokenizer's (`actor_rollout_ref.model.custom_chat_template`), a dataset class
that makes the rows (`data.custom_cls.*`), a sampler class that orders the training prompts (`data.sampler.*`) and
the tool classes of a tool YAML (`multi_turn.tool_config_path`)."""

from __future__ import annotations

from pathlib import Path

from ..data.sampler import is_curriculum, load_sampler_class
from .schema import Config


def check_user_code(cfg: Config, check) -> None:
    """Add each problem to `check` (validate.Checks)."""
    template = cfg.actor_rollout_ref.model.custom_chat_template
    if template is not None:
        problem = chat_template_problem(template)
        check(problem is None, f"actor_rollout_ref.model.custom_chat_template: {problem}", "wrong values")
    _check_dataset_class(cfg.data.custom_cls, check)
    _check_tool_classes(cfg.actor_rollout_ref.rollout.multi_turn, check)
    sampler, key = cfg.data.sampler, "data.sampler"
    if not (sampler.class_path or sampler.class_name):
        return
    if not (sampler.class_path and sampler.class_name):
        check(False, f"{key}.class_path and {key}.class_name name a sampler class together: set both (or neither)",
              "wrong values")
        return
    try:
        cls = load_sampler_class(sampler.class_path, sampler.class_name)
    except ValueError as e:
        check(False, f"{key}.class_path={sampler.class_path!r}, class_name={sampler.class_name!r}: {e}",
              "files, models and packages")
        return
    check.unsupported(cfg.rollout.n_gpus_per_node <= 0 or not is_curriculum(cls),
                      f"{key}.class_name={sampler.class_name} is a curriculum sampler (it has update(batch)) and "
                      "rollout.n_gpus_per_node > 0 runs asynchronous RL, whose generating process draws the prompts "
                      "ahead of the training steps; use it with rollout.n_gpus_per_node=0")


def _check_dataset_class(custom, check) -> None:
    """data.custom_cls names a torch Dataset class that imports (path and name together)."""
    if not (custom.path or custom.name):
        return
    if not (custom.path and custom.name):
        check(False, "data.custom_cls.path and data.custom_cls.name name a dataset class together: set both (or "
                     "neither)", "wrong values")
        return
    from ..data.custom_dataset import load_dataset_class

    try:
        load_dataset_class(custom.path, custom.name)
    except ValueError as e:
        check(False, f"data.custom_cls.path={custom.path!r}, name={custom.name!r}: {e}", "files, models and packages")


def _check_tool_classes(mt, check) -> None:
    """The tool code of multi-turn episodes imports: a function tool file, and the classes a tool YAML names that are
    not posttrain's built-ins (a user's module: the ReTool recipe's `recipe.retool.retool.CustomSandboxFusionTool`),
    with verl's tool interface answered where verl is not installed. The tools are built when the run starts; what
    is wrong with a file itself multi_turn.py says."""
    from .multi_turn import tool_file_problem

    if not mt.enable:
        return
    import yaml

    from ..tools.function import ToolLoadError, load_function_tools
    from ..tools.stateful import VERL_BUILTINS, tool_class

    key = "actor_rollout_ref.rollout.multi_turn"
    path = mt.function_tool_path
    if path is not None and tool_file_problem(str(path), "function_tool_path") is None:
        try:
            load_function_tools(str(path))
        except ToolLoadError as e:
            check(False, f"{key}.function_tool_path: {e}", "files, models and packages")
    path = mt.tool_config_path
    if path is None or tool_file_problem(str(path), "tool_config_path") is not None:
        return
    entries = yaml.safe_load(Path(str(path)).expanduser().read_text(encoding="utf-8"))["tools"]
    for i, entry in enumerate(entries):
        if str(entry["class_name"]) in VERL_BUILTINS:
            continue
        try:
            tool_class(str(entry["class_name"]))
        except ToolLoadError as e:
            check(False, f"{key}.tool_config_path: {path}: tools[{i}]: {e}", "files, models and packages")


def chat_template_problem(template) -> str | None:
    """Why a chat template cannot be used (not text, or not Jinja that transformers compiles), or None."""
    if not isinstance(template, str) or not template.strip():
        return "must be the text of a Jinja chat template"
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers layout: Jinja itself, with the loop controls transformers enables
        import jinja2.ext
        import jinja2.sandbox

        def _compile_jinja_template(text):
            return jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).from_string(text)
    try:
        _compile_jinja_template(template)
    except Exception as e:  # noqa: BLE001 - jinja raises TemplateSyntaxError and others
        return f"is not a Jinja template transformers can compile ({type(e).__name__}: {e})"
    return None
