"""verl's Geo3k tool (`verl.tools.geo3k_tool.Geo3kTool`, its geo3k multi-turn example's tool YAML) loads posttrain's
built-in, which behaves as verl's does: each call grades the submitted answer against the row's ground truth and
answers `Current parsed answer=... reward=...`; its step reward is 0 for an answer better than the last one and -0.05
otherwise; `calc_reward` is the grade of the last answer. Expectations re-derived from verl's tool (geo3k_tool.py:
`compute_score(answer, ground_truth, use_boxed=False, format_score=0.0)`), answers equal as math-verify reads them."""

from pathlib import Path

import pytest
import yaml

from posttrain.tools.builtin.geo3k import Geo3kTool, grade
from posttrain.tools.parse import parse_tool_calls
from posttrain.tools.toolbox import ToolBox

YAML = (Path(__file__).parent / "data" / "multiturn_scripts_2026_04" / "config" / "tool_config" /
        "geo3k_tool_config.yaml")  # verl's examples/sglang_multiturn/config/tool_config/geo3k_tool_config.yaml


def call(answer) -> list:
    import json

    text = "<tool_call>\n" + json.dumps({"name": "calc_geo3k_reward", "arguments": {"answer": answer}}) + \
           "\n</tool_call>"
    return parse_tool_calls(text).calls


def test_verl_geo3k_yaml_loads_the_builtin_with_its_schema():
    box = ToolBox.from_settings(tool_config_path=str(YAML))
    tool = box.tools["calc_geo3k_reward"]
    assert isinstance(tool, Geo3kTool)
    assert box.schemas() == [yaml.safe_load(YAML.read_text())["tools"][0]["tool_schema"]]
    assert Geo3kTool({"type": "native"}).tool_schema == box.schemas()[0]  # the default is the example's schema


def test_each_call_is_graded_and_rewarded_as_verl_does():
    """A wrong answer, the right one (a number), the right one again, a wrong one: verl's messages, its step rewards
    (-0.05 unless the grade rose) and calc_reward the last answer's grade; the session released at the end."""
    box = ToolBox.from_settings(tool_config_path=str(YAML))
    session = box.open({"calc_geo3k_reward": {"create_kwargs": {"ground_truth": "60"}}})
    seen = []
    for answer in ("45", 60, "60", "7"):
        result, = session.run(call(answer))
        seen.append((result.message["content"], result.reward))
    assert seen == [("Current parsed answer='45' reward=0.0", -0.05),
                    ("Current parsed answer='60' reward=1.0", 0.0),
                    ("Current parsed answer='60' reward=1.0", -0.05),
                    ("Current parsed answer='7' reward=0.0", -0.05)]
    assert session.reward() == 0.0  # the last answer's grade, not the best one's
    session.close()
    assert box.tools["calc_geo3k_reward"]._episodes == {}


@pytest.mark.parametrize("answer, truth, score", [
    ("2\\sqrt{3}", "2\\sqrt{3}", 1.0),
    ("2*sqrt(3)", "2\\sqrt{3}", 1.0),  # the same number written otherwise
    ("40/3", "\\frac{40}{3}", 1.0),
    ("13.3", "\\frac{40}{3}", 0.0),
    ("60.0", "60", 1.0),
    ("", "60", 0.0),
    ("   ", "60", 0.0),
])
def test_answers_are_graded_by_value(answer, truth, score):
    assert grade(answer, truth) == score


def test_create_kwargs_in_verls_agent_loop_form_reach_the_tool():
    tool = Geo3kTool({"type": "native"})
    tool.create("e1", create_kwargs={"ground_truth": "12"})
    text, step, metrics = tool.execute("e1", {"answer": "12"})
    assert (text.text, step, metrics) == ("Current parsed answer='12' reward=1.0", 0.0, {})
    assert tool.calc_reward("e1") == 1.0
    tool.release("e1")
    assert tool._episodes == {}
