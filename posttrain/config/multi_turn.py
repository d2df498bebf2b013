"""Checks of multi-turn episodes' settings (actor_rollout_ref.rollout.multi_turn.* and agent.*) when the config
loads: the values the episode loop runs with, the tool files it will read, and the settings it does not run with."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import yaml

from ..tools.builtin.search import config_problem as search_config_problem
from ..tools.parse import FORMATS
from ..tools.stateful import VERL_BUILTINS
from ..tools.targets import is_callable_target, load_callable
from .schema import Config


def check_multi_turn(cfg: Config, check) -> None:
    """Add each problem to `check` (validate.Checks). Environment names beyond their form are checked when the run
    starts: config sits beside agents in the layers, so it cannot read the registry."""
    rollout = cfg.actor_rollout_ref.rollout
    mt, agent, key = rollout.multi_turn, rollout.agent, "actor_rollout_ref.rollout.multi_turn"
    for name in ("max_assistant_turns", "max_user_turns"):
        value = getattr(mt, name)
        check(value is None or value >= 1, f"{key}.{name}={value} must be >= 1 (or null: no limit)", "wrong values")
    for name in ("max_parallel_calls", "max_tool_response_length"):
        check(getattr(mt, name) >= 1, f"{key}.{name}={getattr(mt, name)} must be >= 1", "wrong values")
    check(mt.tool_timeout_s > 0, f"{key}.tool_timeout_s={mt.tool_timeout_s} must be positive (seconds per tool call)",
          "wrong values")
    check(agent.num_workers >= 1, f"actor_rollout_ref.rollout.agent.num_workers={agent.num_workers} must be >= 1",
          "wrong values")
    check.choice(mt.tool_response_truncate_side, ("left", "right", "middle"), f"{key}.tool_response_truncate_side")
    check.choice(mt.tokenization_sanity_check_mode, ("strict", "ignore_strippable", "disable"),
                 f"{key}.tokenization_sanity_check_mode")
    check.unsupported(mt.format in FORMATS, f"{key}.format={mt.format!r}: posttrain parses tool calls in the hermes "
                                           'format (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, as the '
                                           "Qwen2.5 / Qwen3 chat templates write them) and gpt-oss's harmony format "
                                           "(format=gpt-oss); set one of those")
    check.unsupported(mt.format != "gpt-oss" or agent.program is None,
                      f"{key}.format=gpt-oss with actor_rollout_ref.rollout.agent.program: the programs' server reads "
                      "tool calls in the hermes format (the episode loop reads gpt-oss's)")
    check.unsupported(not mt.use_inference_chat_template,
                      f"{key}.use_inference_chat_template=True: posttrain's episodes go on from exactly the tokens "
                      "the policy sampled (only appended messages are tokenized), never a re-rendered conversation; "
                      "set it to False")
    check(isinstance(agent.default_agent_loop, str) and bool(agent.default_agent_loop.strip()),
          "actor_rollout_ref.rollout.agent.default_agent_loop must name an environment (single_turn_agent, "
          "tool_agent or a registered one)", "wrong values")
    for name in ("tool_config_path", "function_tool_path"):
        path = getattr(mt, name)
        if path is not None:
            problem = tool_file_problem(str(path), name)
            check(problem is None, f"{key}.{name}: {problem}", "files, models and packages")
    if agent.agent_loop_config_path is not None:
        problem = agent_loops_file_problem(str(agent.agent_loop_config_path))
        check(problem is None, f"actor_rollout_ref.rollout.agent.agent_loop_config_path: {problem}",
              "files, models and packages")
    check(agent.program_timeout_s > 0, f"actor_rollout_ref.rollout.agent.program_timeout_s={agent.program_timeout_s} "
                                       "must be positive (seconds per program run)", "wrong values")
    if agent.program is not None:
        check_program(str(agent.program), cfg, check)
        server = [k for keys in getattr(cfg, "port_notes", {}).values() for k in keys
                  if k.startswith("actor_rollout_ref.rollout.server.")]
        check.unsupported(not server, f"{', '.join(server)} with actor_rollout_ref.rollout.agent.program: the "
                          "programs' requests go to the policy's server, whose limits are rollout.agent.num_workers "
                          "(programs at once) and rollout.agent.program_timeout_s (a run's time, its requests "
                          "included); remove the rollout.server keys")
        check.unsupported(not vision_model(cfg.actor_rollout_ref.model.path),
                          f"actor_rollout_ref.rollout.agent.program with the vision-language model "
                          f"{cfg.actor_rollout_ref.model.path}: the programs' requests reach posttrain's server as "
                          "text, without the rows' images (the episode loop carries them: drop agent.program)")
    if not mt.enable:
        check(agent.default_agent_loop == "single_turn_agent",
              f"actor_rollout_ref.rollout.agent.default_agent_loop={agent.default_agent_loop} runs multi-turn "
              f"episodes, which need {key}.enable=True (or default_agent_loop=single_turn_agent)")
        return
    check(rollout.name != "hf", f"{key}.enable=True runs episodes on posttrain's engine, which keeps each episode's "
                                "keys and values between its turns; rollout.name=hf (transformers' generate) "
                                "cannot: set rollout.name=posttrain")


def check_program(spec: str, cfg: Config, check) -> None:
    """An agent program: a function that imports (its module is imported now), or a command line that names
    something; served by posttrain's engine; not with ReMax, whose greedy baseline is one response per prompt."""
    from ..algo import estimator_info

    key, rollout = "actor_rollout_ref.rollout.agent.program", cfg.actor_rollout_ref.rollout
    if not spec.strip():
        check(False, f"{key} is empty: name a function (module:function) or a command line, or leave it null",
              "wrong values")
    elif is_callable_target(spec):
        try:
            load_callable(spec)
        except ValueError as e:
            check(False, f"{key}: {e}", "files, models and packages")
    check(rollout.name != "hf", f"{key} runs agent programs against a server over posttrain's engine; "
                                "rollout.name=hf (transformers' generate) cannot serve them: set rollout.name=posttrain")
    check.unsupported(not estimator_info(cfg.algorithm.adv_estimator).needs_greedy_baseline,
                      f"{key} with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: its greedy baseline is one "
                      "response per prompt, and a program gives a prompt any number of samples; use grpo or rloo")


def agent_loops_file_problem(path: str) -> str | None:
    """What is wrong with an agent-loop file (verl's `- name: / _target_:` list), read only; None when it reads."""
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        return f"{path!r} does not exist (or is not a file)"
    try:
        entries = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # yaml and omegaconf raise several types
        return f"{path!r} is not readable YAML ({type(e).__name__}: {e})"
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("name") and e.get("_target_")
                                                 for e in entries):
        return f"{path!r} must hold a list of entries with `name` and `_target_` (package.module.Class)"
    return None


SEARCH_TOOL = "posttrain.tools.builtin.search.SearchTool"


def tool_file_problem(path: str, name: str) -> str | None:
    """What keeps a tool file from loading, found by reading it (nothing is imported or run), or None."""
    file = Path(path).expanduser()
    if not file.is_file():
        return f"'{path}' does not exist (or is not a file)"
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return f"{file} cannot be read as text ({e})"
    if name == "function_tool_path":
        try:
            ast.parse(text, filename=str(file))
        except SyntaxError as e:
            return f"{file} is not valid Python (line {e.lineno}: {e.msg})"
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return f"{file} is not valid YAML ({getattr(e, 'problem', None) or e})"
    tools = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("class_name") for t in tools):
        return (f"{file} must hold a list `tools:` whose entries each have a class_name (and config, tool_schema), "
                "as verl's tool YAML files do")
    missing = [str(t["class_name"]) for t in tools
               if str(t["class_name"]).startswith("verl.") and t["class_name"] not in VERL_BUILTINS]
    if missing:
        return (f"{file} names verl's own tool {', '.join(missing)}, which posttrain has no built-in for (it has "
                f"{', '.join(VERL_BUILTINS)}); write the tool as a class of your own (the interface of "
                "posttrain.tools.stateful.BaseTool) and name its module.Class")
    for t in tools:
        if VERL_BUILTINS.get(t["class_name"], t["class_name"]) == SEARCH_TOOL:
            problem = search_config_problem(t.get("config") or {})
            if problem:
                return f"{file}: {t['class_name']}: {problem}"
    return None


def vision_model(path) -> bool:
    """Whether the model's config.json (a local folder, or a hub id already in the cache) describes a
    vision-language model; False when it cannot be read without downloading (the model is not loaded here)."""
    if not path:
        return False
    local = Path(str(path)).expanduser() / "config.json"
    if not local.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(path), "config.json")
        except Exception:  # noqa: BLE001 - not a hub id: sources.py names the bad path
            return False
        if not isinstance(cached, str):
            return False
        local = Path(cached)
    try:
        return json.loads(local.read_text(encoding="utf-8")).get("vision_config") is not None
    except (OSError, ValueError, AttributeError):
        return False
