"""The OpenAI wire format the server speaks: request bodies (validated) and the error body.

Fields an OpenAI client may send are accepted; the ones the server cannot honour with a non-default value
(penalties, logit bias, top log-probs, forced tool choice, JSON output, echo, suffix, best_of) are refused by
`unsupported` with a 400 naming the field, never silently ignored. Unknown fields are ignored, as OpenAI's
servers do. Responses are plain dicts built in app.py (their layout is the one the OpenAI client parses).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Ignoring(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(Ignoring):
    include_usage: bool = False


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


class Sampling(Ignoring):
    """What chat and text completions share."""
    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # an extra of vLLM's; -1 or 0: off
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]

    def common_unsupported(self) -> str | None:
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty / frequency_penalty are not supported"
        if self.logit_bias:
            return "logit_bias is not supported"
        return None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.top_logprobs:
            return "top_logprobs is not supported (logprobs=true gives each sampled token's log-prob)"
        if self.tool_choice not in (None, "auto", "none"):
            return "tool_choice: only 'auto' and 'none' are supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format: only {'type': 'text'} is supported"
        return self.common_unsupported()

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for text completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs > 0 (top log-probs) is not supported; logprobs=0 gives each sampled token's log-prob"
        if self.echo:
            return "echo is not supported"
        if self.suffix:
            return "suffix is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of is not supported"
        return self.common_unsupported()

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class RewardRequest(Ignoring):
    reward: float


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error layout: the client raises its exception for the status with `message`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
