"""verl's tool interface, for tool classes written against it where verl is not installed: while a user's module
loads, `verl.tools.base_tool`, `verl.tools.schemas` and `verl.utils.rollout_trace` answer with this module
(data/verl_compat.py), so `class MyTool(BaseTool)` with verl's imports loads unchanged.

As verl's: `BaseTool(config, tool_schema)` keeps the schema as an `OpenAIFunctionToolSchema` (pydantic;
`self.tool_schema.function.name`), whether the YAML's dict or the object is given, and `self.name`; `create`,
`execute`, `calc_reward` and `release` are async; `ToolResponse` has verl's fields. The schema models accept the
fields verl's do and keep any other a YAML gives (verl's drop them), so the chat template sees the YAML's schema.
`rollout_trace_op` and `rollout_trace_attr` leave what they wrap unchanged: verl traces only where a trace backend
is configured, which posttrain has none of."""

from __future__ import annotations

import contextlib
from typing import Any, Literal
from uuid import uuid4

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Schema(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIFunctionPropertySchema(_Schema):
    type: str
    description: str | None = None
    enum: list[str] | None = None


class OpenAIFunctionParametersSchema(_Schema):
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]


class OpenAIFunctionSchema(_Schema):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(_Schema):
    type: str
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(_Schema):
    name: str
    arguments: str  # JSON text


class OpenAIFunctionCallSchema(_Schema):
    name: str
    arguments: dict[str, Any]


class OpenAIFunctionToolCall(_Schema):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """A tool's answer. Only `text` reaches the model here: an answer with images or video is a `bad_return`."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, values):
        for key in ("image", "video"):
            if isinstance(values, dict) and key in values and not isinstance(values[key], list):
                raise ValueError(f"{key} must be a list (wrap a single one: [{key}])")
        return values

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video


def rollout_trace_op(fn):
    """verl's tracing decorator: `fn` unchanged (posttrain has no trace backend)."""
    return fn


@contextlib.contextmanager
def rollout_trace_attr(*args, **kwargs):
    """verl's tracing context: nothing to record here."""
    yield


class BaseTool:
    """verl's base tool: subclass and override the async methods."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None):
        self.config = config
        schema = tool_schema or self.get_openai_tool_schema()  # a subclass may give a default
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no tool schema: give tool_schema in the tool config")
        self.tool_schema = OpenAIFunctionToolSchema.model_validate(schema) if isinstance(schema, dict) else schema
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id if instance_id is not None else str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        pass
