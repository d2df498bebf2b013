"""An agent program for the tool task (`posttrain demo --task tools --program`): a plain OpenAI client that offers
the calculator, runs the calls the model makes itself, and returns its own reward — 1.0 when the final answer is
exactly the product, else 0.0.

Training runs it per sample as `run(row, base_url, api_key)` (`actor_rollout_ref.rollout.agent.program=
examples/agent_programs/calculator_agent.py:run`); `python calculator_agent.py` does the same with the row as JSON on
stdin and OPENAI_BASE_URL / OPENAI_API_KEY set (the command form), printing {"reward": x} last. Any server with the
OpenAI API serves it, `posttrain serve MODEL` among them.
"""

from __future__ import annotations

import json
import os
import re
import sys

from openai import OpenAI

from posttrain.data.calculator import CalculatorError, calculate
from posttrain.data.synthetic_tools import tool_schemas

MAX_TURNS = 3


def run(row: dict, base_url: str, api_key: str) -> float:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    messages = [dict(m) for m in row["prompt"]]
    answer = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=tool_schemas(),
                                               max_tokens=48).choices[0].message
        calls = reply.tool_calls or []
        messages.append({"role": "assistant", "content": reply.content or "",
                         **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
        if not calls:
            answer = reply.content or ""
            break
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": calculator(call.function.name, call.function.arguments)})
    return float(re.fullmatch(r"\s*(-?\d+)\.?\s*", answer) is not None
                 and int(answer.strip().rstrip(".")) == int(row["ground_truth"]))


def calculator(name: str, arguments: str) -> str:
    """The tool's answer to one call, errors included (the model reads them)."""
    try:
        expression = json.loads(arguments)["expression"]
        if name != "calculator":
            return f"error: no tool named {name!r}"
        return calculate(expression)
    except (ValueError, KeyError, TypeError, CalculatorError) as e:
        return f"error: {e}"


if __name__ == "__main__":
    print(json.dumps({"reward": run(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"],
                                    os.environ["OPENAI_API_KEY"])}))
