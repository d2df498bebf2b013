"""verifiers environments (`data.environment=verifiers:<id>`): rows from a taskset, and the agent program that plays
a task against an OpenAI-compatible endpoint and returns the task's rubric score. Offline: the environments are
defined here, the endpoint is a stub serving fixed chat completions."""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest

vf = pytest.importorskip("verifiers.v1")
fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from posttrain.agents import verifiers_env  # noqa: E402
from posttrain.errors import ConfigError  # noqa: E402

HERE = __name__  # environments are addressed as verifiers:<this module>:<Taskset class>


# ---- a single-turn environment: add two numbers, reward 1 for the exact sum (weight 2: the score is the weighted sum)
class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=2.0)
    async def exact(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward
    async def short(self, trace: vf.Trace) -> float:
        return 0.5 if len(trace.last_reply) < 4 else 0.0


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for a, b in [(1, 2), (3, 4), (10, 5), (7, 7)]:
            yield SumTask(SumData(prompt=f"What is {a}+{b}?", system_prompt="Answer with a number.",
                                  answer=str(a + b)), self.config.task)


# ---- a tool environment: the model must multiply with the tool; stateful (the tool counts its calls)
class CountState(vf.State):
    calls: int = 0


class Calculator(vf.Toolset[vf.ToolsetConfig, CountState]):
    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        self.state.calls += 1
        return a * b


STOPS: list = []  # each scored trace's stop condition


class MulData(vf.TaskData):
    answer: str


class MulTask(vf.Task[MulData, CountState]):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: MulData, trace: vf.Trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.25)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(trace.state.calls == 1 and len(trace.tool_messages) == 1)

    @vf.metric
    async def stopped_by_turn_limit(self, trace: vf.Trace) -> float:
        STOPS.append(trace.stop_condition)
        return float(trace.is_truncated)


class MulTaskset(vf.Taskset[MulTask]):
    def load(self):
        for a, b in [(6, 7), (12, 12), (3, 9)]:
            yield MulTask(MulData(prompt=f"Compute {a}*{b} with the tool.", answer=str(a * b)), self.config.task)


SUM = f"verifiers:{HERE}:SumTaskset"
MUL = f"verifiers:{HERE}:MulTaskset"


# ---- a stub OpenAI-compatible endpoint: replies come from a script, requests are kept
class Stub:
    """`recorder` (optional, Contract-2 shaped: record(episode, call)) gets one call per request, keyed by the
    bearer key: its prompt continues the episode's previous prompt + completion, as a chat server's would."""

    def __init__(self):
        self.replies: list[dict] = []
        self.requests: list[dict] = []
        self.keys: list[str] = []
        self.recorder = None
        self.history: dict[str, list[int]] = {}
        app = fastapi.FastAPI()

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "x"}]}

        @app.post("/v1/chat/completions")
        async def chat(request: fastapi.Request):
            self.requests.append(await request.json())
            self.keys.append(request.headers.get("authorization", ""))
            message = self.replies.pop(0)
            if self.recorder is not None:
                key = self.keys[-1].removeprefix("Bearer ")
                prompt = self.history[key] + [20] if key in self.history else [1, 2]
                completion = [10 + len(prompt), 3]
                self.history[key] = prompt + completion
                self.recorder.record(key, SimpleNamespace(prompt_ids=prompt, completion_ids=completion,
                                                          logprobs=[-0.5, -0.25], finish_reason="stop"))
            return {"id": "c", "object": "chat.completion", "created": 0, "model": "tiny",
                    "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                 "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{port}/v1"

    def close(self):
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture(scope="module")
def stub():
    s = Stub()
    yield s
    s.close()


def _call(call_id: str, name: str, **arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_single_turn_rows_carry_prompt_and_task():
    train, val = verifiers_env.environment_rows(SUM, val_size=1)
    assert [r["prompt"] for r in train] == [
        [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": f"What is {q}?"}]
        for q in ("1+2", "3+4", "10+5")]
    assert [r["extra_info"]["verifiers"]["task"]["answer"] for r in val] == ["14"]  # the last task is held out
    assert {r["data_source"] for r in train + val} == {verifiers_env.DATA_SOURCE}
    assert [r["extra_info"]["index"] for r in train + val] == [0, 1, 2, 3]
    assert train[0]["extra_info"]["verifiers"]["env"] == SUM


def test_rows_cap_and_refusals():
    train, val = verifiers_env.environment_rows(MUL, train_limit=1, max_turns=3)
    assert len(train) == 1 and val == [] and train[0]["extra_info"]["verifiers"]["max_turns"] == 3
    with pytest.raises(ConfigError, match="none left for training"):
        verifiers_env.environment_rows(MUL, val_size=3)
    with pytest.raises(ConfigError, match="expected 'verifiers:"):
        verifiers_env.load_environment("gsm8k")
    with pytest.raises(ConfigError, match="no Taskset class 'Nope'"):
        verifiers_env.load_environment(f"verifiers:{HERE}:Nope")
    with pytest.raises(ConfigError, match="not_a_module"):
        verifiers_env.load_environment("verifiers:not_a_module.sub")


def test_single_turn_rollout_returns_rubric_score(stub):
    """The program sends the row's conversation to the endpoint with the episode's key, and returns the rubric's
    weighted sum: exact (weight 2) + short (0.5)."""
    row = verifiers_env.environment_rows(SUM)[0][1]  # 3+4
    stub.requests.clear(), stub.keys.clear()
    stub.replies[:] = [{"content": "7"}]
    assert verifiers_env.run_episode(row, stub.base_url, "episode-1") == pytest.approx(2 * 1.0 + 0.5)
    assert stub.requests[0]["messages"] == row["prompt"] and stub.requests[0]["model"] == "tiny"
    assert "tools" not in stub.requests[0]
    assert stub.keys == ["Bearer episode-1"]
    stub.replies[:] = [{"content": "seven, I think"}]
    assert verifiers_env.run_episode(row, stub.base_url, "episode-2") == 0.0


def test_tool_rollout_runs_the_tool_and_scores(stub):
    """A tool call is run (its result goes back as a tool message), the episode's state is what the rewards see,
    and the loop ends at the first reply without tool calls."""
    row = verifiers_env.environment_rows(MUL)[0][0]  # 6*7
    stub.requests.clear()
    stub.replies[:] = [{"content": None, "tool_calls": [_call("c1", "calculator_multiply", a=6, b=7)]},
                       {"content": "The answer is 42."}]
    STOPS.clear()
    assert verifiers_env.run_episode(row, stub.base_url, "e") == pytest.approx(1.0 + 0.25)
    assert STOPS == ["agent_completed"]
    first, second = stub.requests
    assert [t["function"]["name"] for t in first["tools"]] == ["calculator_multiply"]
    assert first["tools"][0]["function"]["parameters"]["required"] == ["a", "b"]
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "42",
                                      "name": "calculator_multiply"}
    assert second["messages"][-2]["tool_calls"][0]["function"]["name"] == "calculator_multiply"


def test_tool_errors_go_back_to_the_model(stub):
    """Bad arguments and unknown tools answer with an error text (the episode goes on); the state counts only the
    call that ran, and max_turns ends a model that never stops calling tools."""
    row = verifiers_env.environment_rows(MUL, max_turns=3)[0][2]  # 3*9
    stub.requests.clear()
    stub.replies[:] = [{"content": None, "tool_calls": [_call("a", "calculator_multiply", a="x", b=1)]},
                       {"content": None, "tool_calls": [_call("b", "nope")]},
                       {"content": None, "tool_calls": [_call("c", "calculator_multiply", a=3, b=9)]}]
    STOPS.clear()
    assert verifiers_env.run_episode(row, stub.base_url, "e") == pytest.approx(0.0 + 0.25 * 0.0)
    assert STOPS == ["max_turns"]
    assert len(stub.requests) == 3 and stub.replies == []
    tool_results = [m["content"] for m in stub.requests[2]["messages"] if m["role"] == "tool"]
    assert tool_results[0].startswith("Error executing tool calculator_multiply")
    assert "unknown tool 'nope'" in tool_results[1]


CALCULATOR_TASKSET = (f"verifiers:{__import__('pathlib').Path(__file__).resolve().parents[1]}"
                      "/examples/verifiers_envs/calculator_taskset.py:CalculatorTaskset")


def test_the_tool_task_as_a_taskset_offers_the_warm_started_tool(stub, tool_model_dir, tmp_path):
    """The tool task's taskset (examples/verifiers_envs/calculator_taskset.py, named by file) holds the task's
    training problems then its held-out ones, offers its tool as `calculator(expression)` (rendered as the SFT
    demonstrations render it, not as verifiers' `<server>_<tool>`), runs it with the safe calculator and rewards
    exactly the product; a missing file is refused with its path, and the demo refuses a taskset whose held-out
    tasks are not the task's test problems."""
    from posttrain.data.synthetic_tools import tool_schemas, write_task
    from posttrain.models.load import load_tokenizer

    train, val = verifiers_env.environment_rows(CALCULATOR_TASKSET, val_size=200)
    files = write_task(tmp_path, seed=0)
    rows = {k: [json.loads(line)["prompt"] for line in files[k].read_text().splitlines()] for k in ("rl_train", "test")}
    assert [r["prompt"] for r in train] == rows["rl_train"] and [r["prompt"] for r in val] == rows["test"]
    from posttrain.tiny.tools_task import environment_overrides

    assert "data.val_max_samples=200" in environment_overrides(CALCULATOR_TASKSET, files["test"])
    with pytest.raises(ConfigError, match="not the tool task's held-out problems"):  # the demo's seed 1: other ones
        environment_overrides(CALCULATOR_TASKSET, write_task(tmp_path / "seed1", seed=1)["test"])

    tools = [t.schema for t in verifiers_env._tools(
        verifiers_env.load_environment(CALCULATOR_TASKSET).task_cls.toolsets(None)).values()]
    tok, talk = load_tokenizer(str(tool_model_dir)), [{"role": "user", "content": "12*34="}]
    assert tok.apply_chat_template(talk, tools=tools, tokenize=False) == tok.apply_chat_template(
        talk, tools=tool_schemas(), tokenize=False)

    row = train[0]  # 1663*365=
    for calls, answer, reward in (("1663*365", "606995", 1.0), ("1663*366", "608658", 0.0), ("16**3", "4096", 0.0)):
        stub.requests.clear()
        stub.replies[:] = [{"content": None, "tool_calls": [_call("c1", "calculator", expression=calls)]},
                           {"content": answer}]
        assert verifiers_env.run_episode(row, stub.base_url, "e") == reward
        result = stub.requests[1]["messages"][-1]["content"]
        assert result == answer if calls != "16**3" else result.startswith("error: only integers")
    with pytest.raises(ConfigError, match="no file"):
        verifiers_env.load_environment("verifiers:no/such/taskset.py:CalculatorTaskset")


def test_row_without_task_is_refused():
    with pytest.raises(ValueError, match="extra_info"):
        verifiers_env.run_episode({"prompt": [], "extra_info": {}}, "http://127.0.0.1:1/v1", "k")


# ---- data.environment in the config and the dataset
def _problems(*overrides) -> str:
    from posttrain.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_config_refuses_environment_with_files_or_a_bad_name():
    text = _problems(f"data.environment={SUM}", "data.train_files=x.jsonl")
    assert "data.environment takes the place of data.train_files" in text
    assert "expected 'verifiers:<module or taskset id>'" in _problems("data.environment=gsm8k")


def test_config_refuses_environment_without_verifiers(monkeypatch):
    """Without the package the config is refused when it loads, and the module says how to install it."""
    monkeypatch.setitem(__import__("sys").modules, "verifiers", None)
    monkeypatch.setitem(__import__("sys").modules, "verifiers.v1", None)
    assert "pip install 'posttrain[verifiers]'" in _problems(f"data.environment={SUM}")
    verifiers_env._cached.cache_clear()
    with pytest.raises(ConfigError, match=r"pip install 'posttrain\[verifiers\]'"):
        verifiers_env.load_environment("verifiers:some_env")


def test_config_sets_the_environment_program(tiny_model_dir):
    """data.environment sets the rollout's agent program to the environment's; another program next to it is
    refused."""
    from posttrain.config import load_config
    from posttrain.config.normalise import ENVIRONMENT_PROGRAM

    assert ENVIRONMENT_PROGRAM.split(":") == [verifiers_env.__name__, verifiers_env.run_episode.__name__]
    cfg = load_config(None, [f"data.environment={SUM}", f"actor_rollout_ref.model.path={tiny_model_dir}"])
    assert cfg.actor_rollout_ref.rollout.agent.program == ENVIRONMENT_PROGRAM
    assert "leave actor_rollout_ref.rollout.agent.program unset" in _problems(
        f"data.environment={SUM}", "actor_rollout_ref.rollout.agent.program=other:fn")


def test_environment_rows_load_as_a_dataset(tiny_tokenizer, tmp_path):
    """The rows the trainer writes for data.environment load like any data file: prompt, data source and the task
    in extra_info, and the held-out tail as validation."""
    from posttrain.config import load_config
    from posttrain.data.dataset import RLDataset
    from posttrain.trainer.setup import _environment_files

    cfg = load_config(None, [f"data.environment={SUM}", "data.val_max_samples=1"], validate=False)
    train_files, val_files = _environment_files(cfg, tmp_path)
    train = RLDataset(train_files, tiny_tokenizer, missing_chat_template="join")
    val = RLDataset(val_files, tiny_tokenizer, missing_chat_template="join")
    assert len(train) == 3 and len(val) == 1
    assert {it.data_source for it in train.items} == {verifiers_env.DATA_SOURCE}
    assert val.items[0].extra_info["verifiers"]["task"]["answer"] == "14"


def test_the_program_runs_under_the_program_runner(stub, tiny_tokenizer):
    """With the config's program string, ProgramRunner runs the environment's rollout per sample: the tool
    episode's two calls become one sample (the tool result's tokens masked) carrying the rubric's score."""
    import contextlib
    import threading

    from posttrain.agents.program import ProgramRunner
    from posttrain.agents.settings import AgentSettings
    from posttrain.config.normalise import ENVIRONMENT_PROGRAM
    from posttrain.rollout.base import SamplingParams

    class Recorder:
        def __init__(self):
            self.calls, self.lock = {}, threading.Lock()

        def record(self, episode, call):
            with self.lock:
                self.calls.setdefault(episode, []).append(call)

        def take(self, episode):
            return self.calls.pop(episode, []), None

        def counts(self):
            return {}

    @contextlib.contextmanager
    def serve(engine, tokenizer, sampling, programs):
        stub.recorder, stub.history = Recorder(), {}
        try:
            yield stub.base_url, stub.recorder
        finally:
            stub.recorder = None

    row = verifiers_env.environment_rows(MUL)[0][1]  # 12*12
    stub.replies[:] = [{"content": None, "tool_calls": [_call("c1", "calculator_multiply", a=12, b=12)]},
                       {"content": "144"}]
    runner = ProgramRunner(SimpleNamespace(pad_id=0), tiny_tokenizer, AgentSettings(program=ENVIRONMENT_PROGRAM),
                           serve=serve)
    [ep] = runner.run([{**row, "uid": "u"}], 1, SamplingParams(max_new_tokens=32))
    assert ep.reward == pytest.approx(1.25)
    assert ep.prompt_ids == [1, 2] and ep.tokens == [12, 3, 20, 15, 3] and ep.mask == [1, 1, 0, 1, 1]
    assert runner.take_metrics()["agent/program_samples"] == 1.0


# ---- against posttrain's own server on a tiny model
@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny model whose tokenizer has the tool chat template and the hermes tokens."""
    from posttrain.data.synthetic_tools import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("verifiers_tiny"), tokenizer_corpus(0, 300), hidden_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=0, tools=True)


def test_rollouts_against_the_posttrain_server(tool_model_dir):
    """The program's requests reach posttrain's server as the rows' conversations (rendered with the environment's
    tools), the server records them under the episode's key, and the reward is one the rubric can give."""
    import torch

    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.registry import build_engine
    from posttrain.serve.app import Served, build_app
    from posttrain.serve.recorder import Recorder
    from posttrain.serve.scheduler import RequestSampling, Scheduler
    from posttrain.serve.server import serve_in_thread

    tokenizer = load_tokenizer(str(tool_model_dir))
    engine = build_engine("posttrain", PolicyModel(load_causal_lm(str(tool_model_dir)).eval()), tokenizer,
                          device=torch.device("cpu"), dtype=torch.float32)
    scheduler, recorder = Scheduler(engine, max_running=4, max_waiting=8), Recorder()
    scheduler.start()
    server = serve_in_thread(build_app(Served("policy", tokenizer, scheduler), recorder=recorder,
                                       sampling_override=RequestSampling(temperature=1.0, max_tokens=12, seed=0)))
    try:
        for spec, possible in ((SUM, {0.0, 0.5, 2.0, 2.5}), (MUL, {0.0, 0.25, 1.0, 1.25})):
            row = verifiers_env.environment_rows(spec, max_turns=2)[0][0]
            reward = verifiers_env.run_episode(row, server.base_url, f"episode-{spec}")
            calls, _ = recorder.take(f"episode-{spec}")
            tools = [t.schema for t in verifiers_env._tools(
                verifiers_env.load_environment(spec).task_cls.toolsets(None)).values()] or None
            ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                **({"tools": tools} if tools else {}))
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            assert reward in possible and 1 <= len(calls) <= 2
            assert calls[0].prompt_ids == ids
            assert len(calls[0].completion_ids) == len(calls[0].logprobs) <= 12
    finally:
        server.close()
        scheduler.close()


def test_grpo_trains_two_steps_on_a_tool_environment(tool_model_dir, tmp_path):
    """data.environment end to end: GRPO runs two steps whose episodes are the environment's rollouts through the
    server, every sample scored by the rubric (none by a reward function), and validates on the held-out task."""
    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    run = tmp_path / "run"
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=2", "data.max_prompt_length=512",
        "data.max_response_length=24", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", f"data.environment={MUL}",
        "data.val_max_samples=1", "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", f"actor_rollout_ref.model.path={tool_model_dir}",
        "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=-1",
        f"trainer.default_local_dir={run}", "trainer.logger=['jsonl']", "trainer.val_before_train=False"])
    RLTrainer(cfg).fit()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["agent/programs"] == 4 and m["agent/program_samples"] >= 1  # 2 prompts x n=2
        assert m.get("agent/program_errors", 0) == 0 and m["agent/program_scored_by_reward_function"] == 0
        assert m["actor/pg_loss"] == m["actor/pg_loss"]
    assert metrics[-1]["val-agent/programs"] == 1


def test_eval_plays_an_environment_s_held_out_tasks_with_its_program(tiny_model_dir, tmp_path):
    """`posttrain eval --environment` evaluates the tasks training holds out (the last --max-samples), each played
    by the environment's program and scored by its rubric (no scorer for its data_source is needed)."""
    from posttrain.trainer.evaluate import EvalArgs, run_eval

    out = tmp_path / "env.jsonl"
    metrics = run_eval(EvalArgs(model=str(tiny_model_dir), data_files=[], environment=CALCULATOR_TASKSET,
                                max_samples=2, max_new_tokens=8, num_workers=0, quiet=True, output=str(out)))
    _, held_out = verifiers_env.environment_rows(CALCULATOR_TASKSET, val_size=2)
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert metrics["val-agent/programs"] == 2
    held_out_prompts = [json.dumps(r["prompt"], sort_keys=True) for r in held_out]
    assert {json.dumps(s["prompt"], sort_keys=True) for s in samples} <= set(held_out_prompts)
    assert len(samples) == metrics["val-agent/program_samples"] >= 1
    assert metrics["val-core/verifiers/acc/mean@1"] == pytest.approx(
        sum(s["score"] > 0 for s in samples) / len(samples))
