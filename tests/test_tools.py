"""Tools for multi-turn episodes: parsing hermes tool calls, function tools (schema from the docstring, loading a
file), verl's tool YAML and the built-ins its class names load, running a turn's calls concurrently within time
limits, and every kind of bad call or failing tool ending as a tool-result message and a counted kind."""

from __future__ import annotations

import json
import sys
import textwrap
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from posttrain.agents.environment import ENVIRONMENTS
from posttrain.agents.episode import Episode
from posttrain.agents.tool_agent import toolbox_for
from posttrain.reward import sandbox
from posttrain.tools import ToolBox, ToolLoadError, function_tool, parse_tool_calls
from posttrain.tools.answers import argument_problem, truncate
from posttrain.tools.builtin.code import CodeInterpreterTool
from posttrain.tools.builtin.gsm8k import Gsm8kTool


def call_text(name, arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ---------------------------------------------------------------- parsing

def test_parse_reads_several_calls_and_keeps_the_text_around_them():
    text = ("Let me check.\n" + call_text("add", {"a": 1, "b": 2}) + "\n"
            + '<tool_call>\n{"name": "echo", "arguments": "{\\"x\\": \\"hi\\"}"}\n</tool_call>')
    turn = parse_tool_calls(text)
    assert turn.content == "Let me check."
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("add", {"a": 1, "b": 2}, None),
                                                                     ("echo", {"x": "hi"}, None)]


def test_parse_without_a_call_and_with_missing_arguments():
    assert parse_tool_calls("The answer is 4.").calls == []
    (call,) = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>').calls
    assert (call.name, call.arguments, call.error) == ("now", {}, None)
    (call,) = parse_tool_calls('<tool_call>{"function": {"name": "f", "arguments": {"a": 1}}}</tool_call>').calls
    assert (call.name, call.arguments) == ("f", {"a": 1})


@pytest.mark.parametrize("text, kind", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}</tool_call>', "malformed_json"),
    ("<tool_call>[1, 2]</tool_call>", "malformed_json"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "missing_name"),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "missing_name"),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>', "bad_arguments"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "unclosed_tag"),
    ('<tool_call><tool_call>{"name": "add", "arguments": {}}</tool_call>', "nested_tag"),
])
def test_parse_never_raises_on_a_malformed_call(text, kind):
    (call,) = parse_tool_calls("before " + text).calls
    assert call.error == kind and call.detail


def test_parse_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parse_tool_calls("", format="xml")


# ---------------------------------------------------------------- function tools

def test_function_tool_schema_comes_from_signature_and_docstring():
    @function_tool
    def multiply(a: int, b: float, note: str = "") -> str:
        """Multiply two numbers.

        Args:
            a: The first factor.
            b: The second factor.
            note: Anything to echo back.
        """
        return str(a * b)

    assert multiply(2, 3.0) == "6.0"  # still a plain function
    assert ToolBox.from_settings(None, function_tool_path=None).schemas() == []
    box = ToolBox([multiply.__posttrain_tool__])
    assert box.schemas() == [{"type": "function", "function": {
        "name": "multiply", "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first factor."},
            "b": {"type": "number", "description": "The second factor."},
            "note": {"type": "string", "description": "Anything to echo back."}},
            "required": ["a", "b"]}}}]


def test_function_tool_rename_and_variadic_refusal():
    @function_tool("lookup")
    def find(key: str) -> str:
        """Find a key.

        Args:
            key: The key.
        """
        return key

    assert find.__posttrain_tool__.schema["function"]["name"] == "lookup"
    with pytest.raises(ValueError, match="named parameters only"):
        @function_tool
        def spread(*values: int) -> str:
            """Spread.

            Args:
                values: Values.
            """


TOOL_FILE = '''
import asyncio
from posttrain.tools import function_tool

@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return str(a + b)

@function_tool
async def shout(text: str) -> dict:
    """Upper-case a text.

    Args:
        text: The text.
    """
    await asyncio.sleep(0)
    return {"text": text.upper()}

@function_tool
def graded(answer: str) -> tuple:
    """Grade an answer.

    Args:
        answer: The answer.
    """
    return "noted", 0.5, {"length": len(answer)}

def helper():  # not a tool
    return 1
'''


def test_function_tool_file_loads_its_marked_functions_and_they_run(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOL_FILE)
    box = ToolBox.from_settings(SimpleNamespace(function_tool_path=str(path)))
    assert [s["function"]["name"] for s in box.schemas()] == ["add", "shout", "graded"]
    calls = parse_tool_calls(call_text("add", {"a": 2, "b": 40}) + call_text("shout", {"text": "hi"})
                             + call_text("graded", {"answer": "abc"})).calls
    results = box.open().run(calls, max_parallel_calls=3)
    assert [r.message for r in results] == [{"role": "tool", "content": "42", "name": "add"},
                                            {"role": "tool", "content": '{"text": "HI"}', "name": "shout"},
                                            {"role": "tool", "content": "noted", "name": "graded"}]
    assert [r.error for r in results] == [None, None, None]
    assert (results[2].reward, results[2].metrics) == (0.5, {"length": 3})


def test_a_verl_function_tool_file_loads_unchanged(tmp_path):
    """A tool file written for verl (`from verl.tools.function_tool import function_tool`) loads as it is where verl
    is not installed, and leaves no `verl` module behind."""
    path = tmp_path / "verl_tools.py"
    path.write_text('from verl.tools.function_tool import function_tool\n\n\n@function_tool("calculator")\n'
                    'def calc(expression: str) -> str:\n    """Evaluate.\n\n    Args:\n        expression: digits.\n'
                    '    """\n    return str(eval(expression, {"__builtins__": {}}, {}))\n')
    box = ToolBox.from_settings(function_tool_path=str(path))
    assert [s["function"]["name"] for s in box.schemas()] == ["calculator"]
    assert box.open().run(parse_tool_calls(call_text("calculator", {"expression": "(3+4)*5"})).calls)[0].message[
        "content"] == "35"
    assert not any(name == "verl" or name.startswith("verl.") for name in sys.modules)


@pytest.mark.parametrize("content, why", [
    (None, "no file at"),
    ("def broken(:\n", "failed to load: SyntaxError"),
    ("import not_a_module_anywhere\n", "failed to load: ModuleNotFoundError"),
    ("def plain(a: int) -> int:\n    return a\n", "defines no tool"),
])
def test_a_bad_function_tool_file_is_refused_with_the_reason(tmp_path, content, why):
    path = tmp_path / "tools.py"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ToolLoadError, match=why):
        ToolBox.from_settings(function_tool_path=str(path))


# ---------------------------------------------------------------- verl's tool YAML

GSM8K_YAML = """\
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""  # verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, verbatim


def test_verl_gsm8k_tool_yaml_loads_the_builtin_and_scores_like_verl(tmp_path):
    path = tmp_path / "gsm8k_tool_config.yaml"
    path.write_text(GSM8K_YAML)
    box = ToolBox.from_settings(tool_config_path=str(path))
    assert isinstance(box.tools["calc_gsm8k_reward"], Gsm8kTool)
    assert box.schemas()[0]["function"]["parameters"]["required"] == ["answer"]
    session = box.open({"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}})
    first, = session.run(parse_tool_calls(call_text("calc_gsm8k_reward", {"answer": "70"})).calls)
    assert first.message["content"] == "Current parsed answer='70' reward=0.0"
    assert first.reward == -0.05  # verl's penalty for an answer no better than the last
    second, = session.run(parse_tool_calls(call_text("calc_gsm8k_reward", {"answer": 72})).calls)
    assert (second.message["content"], second.reward) == ("Current parsed answer='72' reward=1.0", 0.0)
    assert session.reward() == 1.0
    session.close()
    assert box.tools["calc_gsm8k_reward"]._episodes == {}  # released


def test_verl_tool_yaml_shapes_for_code_and_search_load_the_builtins(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(textwrap.dedent("""\
        tools:
          - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
            config:
              sandbox_fusion_url: ""
              num_workers: 10
              enable_global_rate_limit: true
              rate_limit: 10
              default_timeout: 30
              default_language: "python"
              memory_limit_mb: 1024
              type: native
            tool_schema:
              type: "function"
              function:
                name: "code_interpreter"
                description: "A tool for executing code."
                parameters:
                  type: "object"
                  properties:
                    code:
                      type: "string"
                      description: "The code to execute."
                  required: ["code"]
          - class_name: verl.tools.search_tool.SearchTool
            config:
              retrieval_service_url: http://127.0.0.1:8000/retrieve
              num_workers: 120
              rate_limit: 120
              timeout: 30
              type: native
            tool_schema:
              type: function
              function:
                name: search
                description: Searches the web for relevant information based on the given query.
                parameters:
                  type: object
                  properties:
                    query_list:
                      type: array
                      item:
                        type: string
                  required:
                    - query_list
        """))
    box = ToolBox.from_settings(tool_config_path=str(path))
    assert [s["function"]["name"] for s in box.schemas()] == ["code_interpreter", "search"]
    assert type(box.tools["code_interpreter"]).__name__ == "CodeInterpreterTool"
    assert type(box.tools["search"]).__name__ == "SearchTool"


@pytest.mark.parametrize("yaml_text, why", [
    ("tools: 3\n", "top-level `tools:` list"),
    ("tools:\n  - config: {type: native}\n", "has no class_name"),
    ("tools:\n  - class_name: no_such_module.Tool\n    config: {type: native}\n", "cannot be loaded"),
    ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: mcp}\n", "only native"),
])
def test_a_bad_tool_yaml_is_refused_with_the_reason(tmp_path, yaml_text, why):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ToolLoadError, match=why):
        ToolBox.from_settings(tool_config_path=str(path))


def test_from_settings_refuses_a_path_in_place_of_settings_and_unknown_keywords(tmp_path):
    with pytest.raises(TypeError, match="give paths by keyword"):
        ToolBox.from_settings(str(tmp_path / "tools.py"))
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['tool_path'\]"):
        ToolBox.from_settings(tool_path="x")


def test_tool_names_must_be_unique_across_both_sources(tmp_path):
    (tmp_path / "f.py").write_text(TOOL_FILE.replace("def add(", "def calc_gsm8k_reward("))
    (tmp_path / "t.yaml").write_text(GSM8K_YAML)
    with pytest.raises(ToolLoadError, match="two tools are named 'calc_gsm8k_reward'"):
        ToolBox.from_settings(function_tool_path=str(tmp_path / "f.py"), tool_config_path=str(tmp_path / "t.yaml"))


USER_TOOLS = '''
import asyncio, threading
from posttrain.tools import BaseTool, ToolResponse

class Counter(BaseTool):
    """A user's stateful tool, with verl's async methods: counts calls per episode, rewards the count."""
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.counts, self.released = {}, []

    async def create(self, instance_id, start=0, **kwargs):
        self.counts[instance_id] = start
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        self.counts[instance_id] += parameters.get("by", 1)
        return ToolResponse(text=f"count={self.counts[instance_id]}"), None, None

    async def calc_reward(self, instance_id, **kwargs):
        return float(self.counts[instance_id])

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)

class AgentLoopStyle(BaseTool):
    """Written for verl's agent loop, which passes create(create_kwargs={...})."""
    def create(self, instance_id=None, **kwargs):
        self.start = kwargs.get("create_kwargs", {}).get("start")
        return instance_id

class Flaky(BaseTool):
    """Fails where its config says: create, calc_reward, release, or create_hang."""
    def create(self, instance_id, **kwargs):
        if self.config["fail"] == "create":
            raise RuntimeError("no connection")
        if self.config["fail"] == "create_hang":
            threading.Event().wait(30)
        return instance_id

    def execute(self, instance_id, parameters, **kwargs):
        return "fine"

    def calc_reward(self, instance_id, **kwargs):
        if self.config["fail"] == "calc_reward":
            raise ValueError("bad state")
        return 0.0

    def release(self, instance_id, **kwargs):
        if self.config["fail"] == "release":
            raise OSError("disk gone")
'''


def schema(name, **properties):
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": properties}}}


def user_tools_yaml(tmp_path, monkeypatch, entries) -> str:
    (tmp_path / "user_tools_mod.py").write_text(USER_TOOLS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_tools_mod", raising=False)
    path = tmp_path / "user_tools.yaml"
    path.write_text(json.dumps({"tools": entries}))  # JSON is YAML
    return str(path)


def test_a_users_async_stateful_tool_class_loads_and_keeps_state_per_episode(tmp_path, monkeypatch):
    path = user_tools_yaml(tmp_path, monkeypatch, [
        {"class_name": "user_tools_mod.Counter", "config": {"type": "native"},
         "tool_schema": schema("count", by={"type": "integer"})}])
    box = ToolBox.from_settings(tool_config_path=path)
    one, two = box.open({"count": {"create_kwargs": {"start": 10}}}), box.open({})
    assert one.take_errors() == {} and two.take_errors() == {}
    calls = parse_tool_calls(call_text("count", {"by": 5})).calls
    assert one.run(calls)[0].message["content"] == "count=15"
    assert two.run(calls)[0].message["content"] == "count=5"
    assert two.run(calls)[0].reward == 0.0  # a None reward counts as 0
    assert (one.reward(), two.reward()) == (15.0, 10.0)
    one.close()
    one.close()  # once only
    assert box.tools["count"].released == [one.instances["count"]]


def test_create_kwargs_also_reach_a_tool_written_for_verls_agent_loop(tmp_path, monkeypatch):
    path = user_tools_yaml(tmp_path, monkeypatch, [
        {"class_name": "user_tools_mod.AgentLoopStyle", "config": {"type": "native"}, "tool_schema": schema("s")}])
    box = ToolBox.from_settings(tool_config_path=path)
    assert box.open({"s": {"create_kwargs": {"start": 7}}}).take_errors() == {}
    assert box.tools["s"].start == 7


# ---------------------------------------------------------------- built-ins

needs_sandbox = pytest.mark.skipif(not sandbox.sandbox_status()[0], reason="no bubblewrap sandbox on this machine")


@needs_sandbox
def test_code_interpreter_runs_code_in_the_sandbox():
    tool = CodeInterpreterTool({"default_timeout": 5})
    response, reward, _ = tool.execute("i", {"code": "import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)"})
    assert (response.text, reward) == ("42\noops\n", 0.0)
    response, _, _ = tool.execute("i", {"code": "while True: pass", "timeout": 0.5})
    assert "TimeLimitExceeded" in response.text


def test_code_interpreter_uses_a_configured_sandbox_fusion_url():
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"status": "Success", "message": "", "run_result": {
                "status": "Finished", "stdout": "from the server\n", "stderr": "", "return_code": 0,
                "execution_time": 0.01}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tool = CodeInterpreterTool({"sandbox_fusion_url": f"http://127.0.0.1:{server.server_address[1]}/run_code",
                                    "default_timeout": 7, "memory_limit_mb": 256})
        response, _, _ = tool.execute("i", {"code": "print(1)"})
    finally:
        server.shutdown()
        server.server_close()
    assert response.text == "from the server\n"
    assert (seen[0]["code"], seen[0]["run_timeout"], seen[0]["memory_limit_MB"]) == ("print(1)", 7.0, 256)


def test_search_tool_ranks_a_local_corpus_with_bm25(tmp_path):
    pytest.importorskip("bm25s", reason="the search tool needs bm25s (pip install 'posttrain[agents]')")
    from posttrain.tools.builtin.search import SearchTool

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(row) for row in [
        {"id": "1", "contents": "Paris\nParis is the capital and largest city of France."},
        {"id": "2", "contents": "Berlin\nBerlin is the capital of Germany."},
        {"id": "3", "title": "Okapi", "text": "The okapi is a mammal native to the Congo."}]) + "\n")
    tool = SearchTool({"corpus_path": str(corpus), "topk": 1})
    response, _, metrics = tool.execute("i", {"query_list": ["capital of France", "okapi mammal"]})
    assert json.loads(response.text) == {"result": "Doc 1 (Title: Paris)\nParis is the capital and largest city "
                                                   "of France.\n---\nDoc 1 (Title: Okapi)\nThe okapi is a mammal "
                                                   "native to the Congo."}
    assert metrics == {"query_count": 2}
    response, _, _ = tool.execute("i", {"query_list": ["zebra"]})
    assert json.loads(response.text) == {"result": "No search results found."}
    with pytest.raises(ValueError, match="set exactly one of config.retrieval_service_url .* and config.corpus_path"):
        SearchTool({"topk": 1})


def test_a_relative_corpus_path_is_read_beside_the_tool_yaml(tmp_path, monkeypatch):
    """A tool YAML that names its corpus by a relative path finds it beside itself, whatever the working folder."""
    pytest.importorskip("bm25s", reason="the search tool needs bm25s (pip install 'posttrain[agents]')")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "corpus.jsonl").write_text(json.dumps({"contents": "Okapi\nThe okapi lives in the Congo."}))
    (tmp_path / "cfg" / "search.yaml").write_text("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n"
                                                  "    config: {type: native, corpus_path: corpus.jsonl}\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    box = ToolBox.from_settings(tool_config_path="../cfg/search.yaml")
    assert box.tools["search"].docs == [("Okapi", "The okapi lives in the Congo.")]


# ---------------------------------------------------------------- running calls

def test_a_turns_calls_run_at_the_same_time():
    spans = {}

    def slow(tag: str) -> str:
        """Wait a while.

        Args:
            tag: Which call.
        """
        start = time.monotonic()
        time.sleep(0.3)
        spans[tag] = (start, time.monotonic())
        return tag

    box = ToolBox([function_tool(slow).__posttrain_tool__], timeout_s=10)
    started = time.monotonic()
    results = box.open().run(parse_tool_calls(call_text("slow", {"tag": "a"}) + call_text("slow", {"tag": "b"})).calls,
                             max_parallel_calls=2)
    elapsed = time.monotonic() - started
    assert [r.message["content"] for r in results] == ["a", "b"]
    (a0, a1), (b0, b1) = spans["a"], spans["b"]
    assert a0 < b1 and b0 < a1  # the two calls overlapped
    assert elapsed < 0.55  # run one after the other they take at least 0.6 s


def test_argument_checks_follow_the_json_schema():
    parameters = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "string", "nullable": True}, "c": {"type": ["number", "string"]},
        "d": {"type": "string", "enum": ["x", "y"]}}}
    assert argument_problem({"a": 1, "b": None, "c": 2.5, "d": "x"}, parameters) is None
    assert argument_problem({"a": 1, "c": "2"}, parameters) is None
    assert "must be integer, got float" in argument_problem({"a": 1.5}, parameters)
    assert "must be number or string, got list" in argument_problem({"a": 1, "c": [1]}, parameters)
    assert "must be one of ['x', 'y']" in argument_problem({"a": 1, "d": "z"}, parameters)
    assert argument_problem({"a": 1, "z": 0}, {**parameters, "additionalProperties": True}) is None


@pytest.mark.parametrize("side, expected", [
    ("left", "(truncated)...789"), ("right", "012...(truncated)"), ("middle", "0...(truncated)...9")])
def test_truncation_sides_are_verls(side, expected):
    assert truncate("0123456789", 3, side) == (expected, True)
    assert truncate("012", 3, side) == ("012", False)


# ---------------------------------------------------------------- bad calls, end to end through tool_agent

BAD_TOOLS = '''
import asyncio, threading
from posttrain.tools import function_tool

@function_tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return str(a + b)

@function_tool
def explode(x: str) -> str:
    """Raise.

    Args:
        x: Anything.
    """
    raise RuntimeError("kaboom " + x)

@function_tool
async def explode_later(x: str) -> str:
    """Raise from a coroutine.

    Args:
        x: Anything.
    """
    await asyncio.sleep(0)
    raise KeyError(x)

RELEASE = threading.Event()
FINISHED = []

@function_tool
def hang(x: str) -> str:
    """Hang until released.

    Args:
        x: Anything.
    """
    RELEASE.wait(20)
    FINISHED.append(x)
    return x

@function_tool
def odd(x: str) -> str:
    """Return something that is not an answer.

    Args:
        x: Anything.
    """
    return {1, 2}

@function_tool
def nothing(x: str) -> str:
    """Return None.

    Args:
        x: Anything.
    """

@function_tool
def huge(x: str) -> str:
    """Return a long text.

    Args:
        x: Anything.
    """
    return "y" * 10_000
'''


@pytest.fixture
def agent_settings(tmp_path, monkeypatch):
    (tmp_path / "bad_tools.py").write_text(BAD_TOOLS)
    yaml_path = user_tools_yaml(tmp_path, monkeypatch, [
        {"class_name": "user_tools_mod.Flaky", "config": {"type": "native", "fail": fail},
         "tool_schema": schema(f"flaky_{fail}")} for fail in ("create", "calc_reward", "release")])
    return SimpleNamespace(format="hermes", function_tool_path=str(tmp_path / "bad_tools.py"),
                           tool_config_path=yaml_path, max_parallel_calls=4, max_tool_response_length=256,
                           tool_response_truncate_side="middle", tool_timeout_s=0.3)


def start_episode(settings, row=None):
    env = ENVIRONMENTS["tool_agent"](settings)
    reset = env.reset(row or {"raw_prompt": [{"role": "user", "content": "Add 2 and 3."}], "extra_info": {}})
    return env, reset, Episode(prompt_ids=[1, 2], messages=list(reset.messages), tools=reset.tools)


def assistant_turn(env, episode, text):
    episode.messages.append({"role": "assistant", "content": text})
    step = env.step(episode)
    episode.messages += step.messages
    return step


BAD_CALLS = [  # (what the model wrote, the kind counted, a phrase the answer to the model holds)
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}</tool_call>', "malformed_json", "not valid JSON"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', "missing_name", 'no "name"'),
    ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "bad_arguments", "must be an object"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "unclosed_tag", "never closed"),
    ('<tool_call><tool_call>{"name": "add"}</tool_call>', "nested_tag", "inside another"),
    (call_text("subtract", {"a": 1}), "unknown_tool", "unknown tool 'subtract'. Available tools: ['add', "),
    (call_text("add", {"a": 1}), "bad_arguments", "missing required argument(s) ['b']"),
    (call_text("add", {"a": 1, "b": "two"}), "bad_arguments", "argument 'b' must be integer, got str"),
    (call_text("add", {"a": 1, "b": True}), "bad_arguments", "argument 'b' must be integer, got bool"),
    (call_text("add", {"a": 1, "b": 2, "c": 3}), "bad_arguments", "unknown argument(s) ['c']"),
    (call_text("explode", {"x": "now"}), "tool_raised", "RuntimeError: kaboom now"),
    (call_text("explode_later", {"x": "k"}), "tool_raised", "KeyError: 'k'"),
    (call_text("hang", {"x": "1"}), "timeout", "did not answer within 0.3 s"),
    (call_text("odd", {"x": "1"}), "bad_return", "returned a set"),
    (call_text("nothing", {"x": "1"}), "bad_return", "returned a NoneType"),
    (call_text("huge", {"x": "1"}), "truncated", "...(truncated)..."),
    (call_text("flaky_create", {}), "create_failed", "unavailable in this episode: its set-up failed "
                                                     "(RuntimeError: no connection)"),
]


@pytest.mark.parametrize("text, kind, phrase", BAD_CALLS, ids=[f"{i}-{k}" for i, (_, k, _) in enumerate(BAD_CALLS)])
def test_a_bad_call_becomes_a_tool_message_and_a_counted_kind(agent_settings, text, kind, phrase):
    env, _, episode = start_episode(agent_settings)
    step = assistant_turn(env, episode, "Let me use a tool. " + text)
    (message,) = step.messages
    assert message["role"] == "tool" and phrase in message["content"], message
    assert not step.done
    assert episode.tool_calls == 1
    expected = Counter({kind: 1}) + Counter(create_failed=1)  # (flaky_create's set-up failed at the start)
    assert episode.tool_errors == dict(expected)
    if kind == "truncated":
        assert len(message["content"]) == 256 + len("...(truncated)...")
    # the episode goes on: a good call next turn is answered
    step = assistant_turn(env, episode, call_text("add", {"a": 2, "b": 3}))
    assert step.messages == [{"role": "tool", "content": "5", "name": "add"}]
    env.close()


def test_a_hung_tool_is_abandoned_not_waited_for(agent_settings):
    env, _, episode = start_episode(agent_settings)
    module = SimpleNamespace(**env.toolbox.tools["hang"].fn.__globals__)  # the tool file's globals
    step = assistant_turn(env, episode, call_text("hang", {"x": "late"}) + call_text("add", {"a": 1, "b": 1}))
    assert module.FINISHED == []  # the call returned while the tool still hung
    module.RELEASE.set()
    assert [m["content"][:40] for m in step.messages] == ["Error: tool 'hang' did not answer within", "2"]
    assert episode.tool_errors["timeout"] == 1


def test_too_many_calls_run_the_first_ones_and_answer_the_rest(agent_settings):
    agent_settings.max_parallel_calls = 2
    env, _, episode = start_episode(agent_settings)
    step = assistant_turn(env, episode, "".join(call_text("add", {"a": i, "b": 1}) for i in range(3)))
    assert [m["content"] for m in step.messages[:2]] == ["1", "2"]
    assert "at most 2 tool call(s) run per turn" in step.messages[2]["content"]
    assert episode.tool_errors["too_many_calls"] == 1 and episode.tool_calls == 3


def test_failing_calc_reward_and_release_are_counted_when_the_episode_ends(agent_settings):
    env, reset, episode = start_episode(agent_settings)
    assert [t["function"]["name"] for t in reset.tools] == [
        "add", "explode", "explode_later", "hang", "odd", "nothing", "huge", "flaky_create", "flaky_calc_reward",
        "flaky_release"]
    step = assistant_turn(env, episode, "The answer is 5.")
    assert step.done and step.messages == [] and step.reward == 0.0
    assert episode.tool_errors == {"create_failed": 1, "reward_failed": 1, "release_failed": 1}
    env.close()  # already released: nothing more is counted or raised


def test_a_hung_create_is_a_failed_set_up_not_a_hang(tmp_path, monkeypatch):
    path = user_tools_yaml(tmp_path, monkeypatch, [
        {"class_name": "user_tools_mod.Flaky", "config": {"type": "native", "fail": "create_hang"},
         "tool_schema": schema("stuck")}])
    session = ToolBox.from_settings(tool_config_path=path, tool_timeout_s=0.2).open({})
    assert session.take_errors() == {"create_failed": 1}
    (result,) = session.run(parse_tool_calls(call_text("stuck", {})).calls)
    assert result.error == "create_failed" and "no answer within" in result.message["content"]


# ---------------------------------------------------------------- the environments

def test_tool_agent_passes_tools_kwargs_and_records_the_tools_reward_without_adding_it(tmp_path):
    """verl's rule: the tools' rewards are recorded (`tool_reward`), the episode's reward is the scorer's."""
    (tmp_path / "t.yaml").write_text(GSM8K_YAML)
    settings = SimpleNamespace(format="hermes", function_tool_path=None, tool_config_path=str(tmp_path / "t.yaml"),
                               max_parallel_calls=1, max_tool_response_length=256,
                               tool_response_truncate_side="middle", tool_timeout_s=5.0)
    row = {"prompt": [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Q?"}],
           "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "18"}}}}}
    env, reset, episode = start_episode(settings, row)
    assert reset.messages == row["prompt"] and reset.tools[0]["function"]["name"] == "calc_gsm8k_reward"
    step = assistant_turn(env, episode, "So 18.\n" + call_text("calc_gsm8k_reward", {"answer": "18"}))
    assert step.messages == [{"role": "tool", "content": "Current parsed answer='18' reward=1.0",
                              "name": "calc_gsm8k_reward"}]
    assert (step.reward, step.done, episode.tool_calls, episode.tool_errors) == (0.0, False, 1, {})
    assert episode.tool_time_s > 0
    step = assistant_turn(env, episode, "#### 18")
    assert (step.done, step.reward, episode.tool_reward) == (True, 0.0, 1.0)
    assert toolbox_for(settings) is env.toolbox  # loaded once per run, not per episode
    row["extra_info"]["tools_kwargs"] = json.dumps(row["extra_info"]["tools_kwargs"])  # as some files keep it
    env, _, episode = start_episode(settings, row)
    assistant_turn(env, episode, call_text("calc_gsm8k_reward", {"answer": "18"}))
    assert assistant_turn(env, episode, "#### 18").reward == 0.0 and episode.tool_reward == 1.0


def test_single_turn_agent_is_done_after_one_turn():
    env = ENVIRONMENTS["single_turn_agent"](SimpleNamespace())
    reset = env.reset({"raw_prompt": [{"role": "user", "content": "Hi"}]})
    assert (reset.messages, reset.tools) == ([{"role": "user", "content": "Hi"}], None)
    episode = Episode(prompt_ids=[1], messages=reset.messages + [{"role": "assistant", "content": "<tool_call>"}])
    assert env.step(episode).done
