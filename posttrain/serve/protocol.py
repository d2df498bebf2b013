"""The OpenAI wire format the server speaks: request bodies (validated) and the error body.

Every field of these models acts (fields.py says how; tests/test_serve_fields.py checks each); vLLM's fields that
posttrain does not implement are kept as extras and refused by `fields.screen` with a 400 naming them when given
a value other than their default; fields neither API knows are ignored with a warning in the log, as vLLM does.
Responses are plain dicts built in app.py and answers.py (their layout is the one the OpenAI client parses).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Ignoring(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # Python's JSON reads NaN and Infinity


class StreamOptions(Ignoring):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true


class FunctionCall(Ignoring):
    name: str
    arguments: str | dict = "{}"


class ToolCall(Ignoring):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Ignoring):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Sampling(BaseModel):
    """What chat and text completions share (vLLM's extras included; other fields kept in `model_extra`)."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # an extra of vLLM's; -1 or 0: off
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # an int64, as vLLM's and torch's generators take
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    session_id: str | None = None
    request_id: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for text completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class RewardRequest(Ignoring):
    reward: float = Field(allow_inf_nan=False)  # JSON's 1e999 parses as inf


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error layout: the client raises its exception for the status with `message`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
