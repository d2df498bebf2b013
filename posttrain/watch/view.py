"""What the detectors read of a step's batch, taken out of it once: per response its prompt, its text, the policy's
own text, its reward and the reward's components, its length, and for a multi-turn episode the tool calls and
tool results. Built from a `data.Batch` by `step_view`; tests build one directly."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

NOT_COMPONENTS = ("score", "acc", "pass_rate", "errors", "timeouts", "response_text")  # correctness, counts, text
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class Sample:
    """One response of the step (a row of the batch)."""

    uid: str  # the prompt's id: the responses of one prompt share it (a group)
    prompt: str  # what the policy was asked: the prompt's message contents, joined
    response: str  # everything after the prompt, as the scorer read it (tool results too, in an episode)
    policy_text: str  # what the policy itself wrote (its assistant turns; the response in a single-turn batch)
    score: float = 0.0
    acc: float = 0.0  # the scorer's correctness (`acc`, else score > 0)
    components: dict[str, float] = field(default_factory=dict)  # the reward's other numeric keys
    length: int = 0  # response tokens (policy and appended), what counts against the length limit
    data_source: str = ""
    ground_truth: str = ""
    messages: list[dict] | None = None  # an episode's conversation; None for a single-turn response
    tool_calls: list[str] = field(default_factory=list)  # each call of an episode as canonical text, in order
    tool_results: list[str] = field(default_factory=list)  # the tool messages' contents


@dataclass
class StepView:
    step: int
    samples: list[Sample]
    max_length: int  # data.max_response_length: a response this long was cut at the limit

    def groups(self) -> dict[str, list[int]]:
        """Rows by prompt (uid), in batch order."""
        out: dict[str, list[int]] = {}
        for i, s in enumerate(self.samples):
            out.setdefault(s.uid, []).append(i)
        return out

    def sample_id(self, row: int) -> str:
        """`<uid>:<k>`: the k-th response of that prompt in this step (uids are unique per step: s<step>-<index>)."""
        uid = self.samples[row].uid
        return f"{uid}:{sum(1 for s in self.samples[:row] if s.uid == uid)}"


def message_text(content) -> str:
    """A message's text: a string, or the text parts of a multimodal content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def canonical_calls(message: dict) -> list[str]:
    """The tool calls of an assistant message as canonical text (`name {sorted JSON arguments}`): OpenAI-style
    `tool_calls` where the message has them, else hermes `<tool_call>{...}</tool_call>` blocks in its content (a
    block that is not JSON counts as its stripped text)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append(f"{fn.get('name')} {json.dumps(args, sort_keys=True)}")
    if calls:
        return calls
    for block in _HERMES_CALL.findall(message_text(message.get("content"))):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            calls.append(block.strip())
            continue
        if isinstance(call, dict):
            calls.append(f"{call.get('name')} {json.dumps(call.get('arguments'), sort_keys=True)}")
        else:
            calls.append(json.dumps(call, sort_keys=True))
    return calls


def _number(value) -> float | None:
    """A finite number (a bool counts, as in the reward's metrics), else None."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def step_view(batch, step: int, max_length: int) -> StepView:
    """The view of a scored batch (its meta holds the reward extras as `reward:<key>`, an episode per row in
    multi-turn runs)."""
    from ..data.batch import response_attention

    m, n = batch.meta, len(batch)
    lengths = response_attention(batch).sum(-1).tolist()
    texts = m.get("reward:response_text") or [""] * n
    episodes = m.get("episode") or [None] * n
    keys = [k.split(":", 1)[1] for k in m if k.startswith("reward:") and k.split(":", 1)[1] not in NOT_COMPONENTS]
    scores = m.get("reward:score") or batch["token_level_scores"].sum(-1).tolist()
    accs = m.get("reward:acc") or [float(s > 0) for s in scores]
    samples = []
    for i in range(n):
        raw = (m.get("raw_prompt") or [None] * n)[i]
        prompt = " ".join(message_text(msg.get("content")) for msg in raw) if isinstance(raw, list) else str(raw or "")
        ep = episodes[i]
        components = {k: v for k in keys if (v := _number(m[f"reward:{k}"][i])) is not None}
        sample = Sample(uid=str(m["uid"][i]), prompt=prompt, response=texts[i], policy_text=texts[i],
                        score=float(scores[i] or 0.0), acc=float(accs[i] or 0.0), components=components,
                        length=int(lengths[i]), data_source=str(m.get("data_source", [""] * n)[i]),
                        ground_truth=str(m.get("ground_truth", [""] * n)[i]))
        if ep is not None:
            add_episode(sample, list(ep.messages))
        samples.append(sample)
    return StepView(step, samples, max_length)


def add_episode(sample: Sample, messages: list[dict]) -> None:
    """Fill `sample`'s episode fields from its conversation: the turns from its first assistant message on."""
    first = next((i for i, t in enumerate(messages) if t.get("role") == "assistant"), len(messages))
    turns = messages[first:]
    sample.messages = messages
    sample.policy_text = "\n".join(message_text(t.get("content")) for t in turns if t.get("role") == "assistant")
    sample.tool_calls = [c for t in turns if t.get("role") == "assistant" for c in canonical_calls(t)]
    sample.tool_results = [message_text(t.get("content")) for t in turns if t.get("role") == "tool"]
