"""Prompt datasets over parquet / jsonl files in the RL data layout (DESIGN.md), tokenised with the chat template."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from .rows import (DataError, RowNotes, agent_name_of, data_source_of, extra_info_of, ground_truth_of, missing_column,
                   prompt_messages, with_tools_kwargs)


def _as_list(files) -> list:
    """File paths as strings; a source of rows (an object with `rows()`, custom_dataset.CustomRows) as it is."""
    if files is None:
        return []
    if isinstance(files, str) or hasattr(files, "rows"):
        return [files]
    return [f if hasattr(f, "rows") else str(f) for f in files]


def layout_row(data_source: str, user_text: str, ground_truth: str, extra_info: dict, ability: str = "math") -> dict:
    """One row of the RL data layout (DESIGN.md): a single user turn scored by the rule scorer of ``data_source``."""
    return {"data_source": data_source, "prompt": [{"role": "user", "content": user_text}], "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": ground_truth}, "extra_info": extra_info}


def tool_agent_row(data_source: str, system: str, user_text: str, ground_truth: str, extra_info: dict, tool: str,
                   ability: str = "math") -> dict:
    """One row of the tool-agent layout (verl's): a system turn offering `tool`, the question, episodes run by the
    `tool_agent` environment, and the ground truth given to the tool when its episode's instance is created."""
    return {"data_source": data_source, "agent_name": "tool_agent",
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": user_text}],
            "ability": ability, "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {**extra_info, "need_tools_kwargs": True,
                           "tools_kwargs": {tool: {"create_kwargs": {"ground_truth": ground_truth}}}}}


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(1-based line number, row) for each non-blank line of a jsonl file, so later checks can name the line too."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    rows = []
    offset = 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not UTF-8: byte {offset + e.start} of the file is "
                                f"{raw[e.start:e.start + 1]!r}; save the file as UTF-8") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: row {lineno - 1} (line {lineno}) is not valid JSON: {e.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {lineno - 1} (line {lineno}) is not a JSON object")
            rows.append((lineno, row))
    return rows


def read_rows(path: str | Path) -> list[dict]:
    """All rows of one parquet or jsonl file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
    if path.suffix in (".jsonl", ".json"):
        return [row for _, row in read_jsonl(path)]
    raise DataError(f"{path}: unsupported file type '{path.suffix}' (use .parquet or .jsonl)")


MISSING_CHAT_TEMPLATE = ("error", "join")


def check_chat_template(tokenizer, missing: str, option: str) -> None:
    """A tokenizer without a chat template is an error unless the fallback (contents joined by newlines) is asked
    for: a chat model fed untemplated text trains on a format it will never see."""
    if missing not in MISSING_CHAT_TEMPLATE:
        raise DataError(f"{option}={missing!r} is not one of {list(MISSING_CHAT_TEMPLATE)}")
    if missing == "error" and not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"the tokenizer '{name}' has no chat template; give a tokenizer that has one "
                        f"(chat_template.jinja in its folder), or set {option}=join to feed the message contents "
                        "joined by newlines (base models)")


def encode_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None,
                  where: str = "a prompt", tools: list[dict] | None = None) -> list[int]:
    """Token ids of the chat template applied to `messages` (with the generation prompt, and the tool schemas
    `tools` where given); without a template, the contents joined by newlines (check_chat_template decides whether
    that is allowed)."""
    if getattr(tokenizer, "chat_template", None):
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                **({"tools": tools} if tools else {}), **(template_kwargs or {}))
        except Exception as e:  # jinja errors of a template that rejects this conversation (e.g. a system turn)
            raise DataError(f"{where}: the tokenizer's chat template failed on this row "
                            f"({type(e).__name__}: {e})") from None
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return list(ids)
    return tokenizer("\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"]


def check_tools_template(tokenizer, tools: list[dict], template_kwargs: dict) -> str | None:
    """Tool schemas reach the policy through the chat template's `tools=`: an error without a template, and a note
    (returned) when the template renders the same prompt without them."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("tools are offered through the chat template's tools=, and the tokenizer has none; give a "
                        "tokenizer whose chat template renders tools (e.g. Qwen2.5's)")
    def render(**with_tools) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": "?"}], add_generation_prompt=True,
                                             tokenize=False, **with_tools, **template_kwargs)

    if render(tools=tools) == render():
        return ("the tokenizer's chat template does not render tools=: the tool schemas do not reach the policy, "
                "only what the prompts say about the tools")
    return None


def encode_with_images(processor, messages: list[dict], images, where: str, image_key: str,
                       template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                       tools: list[dict] | None = None):
    """Token ids (image tokens included) and image inputs of a row with images, by the model's own processor;
    `<image>` placeholders in the messages mark where each image goes; `tools`: the schemas for the template."""
    from ..models.vision import VisionDataError, image_messages, load_image

    images = list(images) if images is not None else []
    if images and processor is None:
        raise DataError(f"{where}: column '{image_key}' holds images, but the model is text-only (its config has "
                        "no vision_config); use a vision-language model such as Qwen2.5-VL")
    try:
        pictures = [load_image(im, f"{where}, column '{image_key}', image {i}") for i, im in enumerate(images)]
        return processor.encode(image_messages(messages, len(pictures), where), pictures,
                                template_kwargs=template_kwargs, add_generation_prompt=add_generation_prompt,
                                tools=tools)
    except VisionDataError as e:
        raise DataError(str(e)) from None


def truncate(ids: list[int], limit: int, how: str, where: str) -> list[int]:
    if len(ids) <= limit:
        return ids
    if how == "left":
        return ids[-limit:]
    if how == "right":
        return ids[:limit]
    if how == "middle":
        head = limit // 2
        return ids[:head] + ids[len(ids) - (limit - head):]
    raise DataError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={limit}; raise the limit, set "
                    "data.filter_overlong_prompts=True, or data.truncation=left|right|middle")


@dataclass
class PromptItem:
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    raw_prompt: list | None = None
    images: dict | None = None  # the model's image inputs of this prompt (pixel_values, image_grid_thw)
    agent_name: str | None = None  # the environment of this prompt's episodes (the row's agent_name column)


class RLDataset:
    """Tokenised prompts with their scoring fields; filtering and truncation per the data.* keys."""

    def __init__(self, files, tokenizer, *, prompt_key="prompt", reward_fn_key="data_source", max_prompt_length=512,
                 filter_overlong_prompts=False, truncation="error", return_raw_chat=False, image_key="images",
                 max_samples=-1, apply_chat_template_kwargs=None, missing_chat_template="error", processor=None,
                 tools=None, agent_names=None):
        """`processor`: a vision-language model's VisionProcessor (models/vision.py); rows with images need one.
        `tools`: the JSON schemas of the tools multi-turn episodes offer; prompts are encoded with them (the chat
        template's `tools=`), so prompt lengths and the overlong filter count them as the policy will see them.
        `agent_names`: the environments a run has (registered ones); a row's agent_name must be one of them."""
        self.items: list[PromptItem] = []
        self.processor = processor
        self.tools = list(tools) if tools else None
        self.agent_names = sorted(agent_names) if agent_names is not None else None
        self.template_kwargs = dict(apply_chat_template_kwargs or {})
        self.num_filtered = 0
        self.row_notes = RowNotes()
        paths = _as_list(files)
        if not paths:
            raise DataError("no data files given (data.train_files / data.val_files)")
        check_chat_template(tokenizer, missing_chat_template, "data.missing_chat_template")
        tools_note = self.tools and check_tools_template(tokenizer, self.tools, self.template_kwargs)
        shortest, seen = None, 0
        for path in paths:
            for i, row in enumerate(path.rows() if hasattr(path, "rows") else read_rows(path)):
                if 0 <= max_samples <= len(self.items):
                    break
                where = f"{path}: row {i}"
                seen += 1
                item = self._item(row, where, tokenizer, prompt_key, reward_fn_key, image_key, return_raw_chat)
                if len(item.prompt_ids) > max_prompt_length and filter_overlong_prompts:
                    self.num_filtered += 1
                    shortest = min(shortest or len(item.prompt_ids), len(item.prompt_ids))
                    continue
                if item.images is not None and len(item.prompt_ids) > max_prompt_length:
                    raise DataError(f"{where}: prompt has {len(item.prompt_ids)} tokens with its image tokens > "
                                    f"data.max_prompt_length={max_prompt_length}, and a prompt with images is never "
                                    "truncated (it would cut image tokens); raise the limit or set "
                                    "data.filter_overlong_prompts=True")
                item.prompt_ids = truncate(item.prompt_ids, max_prompt_length, truncation, where)
                self.items.append(item)
        self.notes = self.row_notes.messages() + ([tools_note] if tools_note else []) + [
            note for path in paths for note in getattr(path, "notes", [])]
        if filter_overlong_prompts:
            self.notes.insert(0, f"data.filter_overlong_prompts dropped {self.num_filtered} of {seen} rows of "
                                 f"{paths} (prompts longer than data.max_prompt_length={max_prompt_length} tokens)")
        if not self.items and self.num_filtered:
            raise DataError(f"data.filter_overlong_prompts dropped all {seen} rows of {paths}: every prompt is longer "
                            f"than data.max_prompt_length={max_prompt_length} tokens (the shortest has {shortest}); "
                            "raise data.max_prompt_length")
        if not self.items:
            raise DataError(f"{paths}: no rows (the files are empty)")

    def _item(self, row, where, tokenizer, prompt_key, reward_fn_key, image_key, return_raw_chat) -> PromptItem:
        for column, option in ((prompt_key, "data.prompt_key"), (reward_fn_key, "data.reward_fn_key")):
            if column not in row:
                raise missing_column(where, column, row, option)
        reward = row.get("reward_model")
        if not isinstance(reward, dict) or "ground_truth" not in reward:
            raise DataError(f"{where}: column 'reward_model' must be a struct with 'ground_truth', got {reward!r:.80}")
        messages = prompt_messages(row[prompt_key], f"{where}, column '{prompt_key}'")
        extra_info = with_tools_kwargs(extra_info_of(row.get("extra_info"), where), where)
        data_source = data_source_of(row[reward_fn_key], where, reward_fn_key)
        truth = ground_truth_of(reward["ground_truth"], where, self.row_notes)
        if return_raw_chat:  # scorers see the conversation, e.g. to grade with their own template
            extra_info["raw_prompt"] = messages
        images = None
        if row.get(image_key) is not None and len(row[image_key]) or self.processor is not None:
            ids, images = encode_with_images(self.processor, messages, row.get(image_key), where, image_key,
                                             self.template_kwargs, tools=self.tools)
        else:
            ids = encode_prompt(tokenizer, messages, self.template_kwargs, where, self.tools)
        return PromptItem(prompt_ids=ids, data_source=data_source, ground_truth=truth, extra_info=extra_info,
                          raw_prompt=messages, images=images,  # raw_prompt: for the reward model's own template
                          agent_name=agent_name_of(row.get("agent_name"), where, self.agent_names))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]


def epoch_batches(n_items: int, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
                  drop_last: bool = True) -> Iterator[list[int]]:
    """Index lists of one epoch; the order depends only on (seed, epoch), so a resumed run sees the same batches."""
    order = list(range(n_items))
    if shuffle:
        random.Random(seed * 100003 + epoch).shuffle(order)
    stop = n_items - n_items % batch_size if drop_last else n_items
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]


def collate_prompts(items: Sequence[PromptItem], pad_id: int):
    """Left-padded prompt ids and mask (B, P) plus the per-prompt fields."""
    import torch

    width = max(len(it.prompt_ids) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        ids[i, width - len(it.prompt_ids):] = torch.tensor(it.prompt_ids)
        mask[i, width - len(it.prompt_ids):] = 1
    return ids, mask


class SFTDataset:
    """Supervised examples in the same layout, each token ids with a loss mask (1 on the tokens the model learns).

    A row is either a prompt column plus a response column (a string) — prompt ids (chat template, generation
    prompt) + response ids + EOS, the loss on the response and its EOS — or a conversation: a `messages_key` column
    (system / user / assistant / tool messages) and optionally a `tools_key` column (function schemas for the
    template's `tools=`). A conversation is tokenized turn by turn, as a multi-turn rollout builds it: each
    assistant message is its content's ids + EOS with loss 1 (what the policy writes), everything between them —
    the other messages and the template's own tokens — is the template's rendering with loss 0. With a
    vision-language `processor` (models/vision.py) prompt/response rows may hold images in `image_key`, as in
    RLDataset; `images[i]` are example i's image inputs (or None).
    """

    def __init__(self, files, tokenizer, *, prompt_key="prompt", response_key="response", max_length=1024,
                 truncation="error", missing_chat_template="error", processor=None, image_key="images",
                 messages_key="messages", tools_key="tools"):
        self.examples: list[tuple[list[int], list[int]]] = []  # (ids, loss mask)
        self.images: list[dict | None] = []
        check_chat_template(tokenizer, missing_chat_template, "--missing-chat-template")
        for path in _as_list(files):
            for i, row in enumerate(read_rows(path)):
                where = f"{path}: row {i}"
                if messages_key in row and response_key not in row:
                    ids, mask = conversation_tokens(tokenizer, row[messages_key], row.get(tools_key), where,
                                                    f"column '{messages_key}'")
                    images = None
                else:
                    ids, mask, images = self._prompt_response(row, where, tokenizer, prompt_key, response_key,
                                                              processor, image_key)
                if len(ids) > max_length:
                    if truncation == "error":
                        raise DataError(f"{where}: {len(ids)} tokens > max_length={max_length}")
                    keep = max(max_length, mask.index(1) + 1 if 1 in mask else 1)
                    ids, mask = ids[:keep], mask[:keep]
                self.examples.append((ids, mask))
                self.images.append(images)
        if not self.examples:
            raise DataError(f"{files}: no rows")

    @staticmethod
    def _prompt_response(row, where, tokenizer, prompt_key, response_key, processor, image_key):
        for column, option in ((prompt_key, "--prompt-key"), (response_key, "--response-key")):
            if column not in row:
                raise missing_column(where, column, row, option)
        if not isinstance(row[response_key], str):
            raise DataError(f"{where}, column '{response_key}': expected a string, got {row[response_key]!r:.80}")
        messages = prompt_messages(row[prompt_key], f"{where}, column '{prompt_key}'")
        images = None
        if row.get(image_key) is not None and len(row[image_key]) or processor is not None:
            prompt, images = encode_with_images(processor, messages, row.get(image_key), where, image_key)
        else:
            prompt = encode_prompt(tokenizer, messages, where=where)
        response = tokenizer(row[response_key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt + response, [0] * len(prompt) + [1] * len(response), images

    def __len__(self) -> int:
        return len(self.examples)

    def collate(self, indices: Sequence[int], pad_id: int):
        """Right-padded input_ids, attention_mask and loss_mask (B, T)."""
        import torch

        seqs = [self.examples[i] for i in indices]
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        loss = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, (tokens, mask) in enumerate(seqs):
            ids[i, :len(tokens)] = torch.tensor(tokens)
            attn[i, :len(tokens)] = 1
            loss[i, :len(tokens)] = torch.tensor(mask)
        return ids, attn, loss


def conversation_tokens(tokenizer, messages, tools, where: str, column: str) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a conversation: 1 on each assistant message's content and its EOS, 0 elsewhere.

    The text between two assistant turns is the template's rendering of the conversation so far past what the
    previous assistant turn ended with (its text and the EOS token), tokenized on its own, as a rollout appends it;
    a template whose rendering of earlier turns changes as the conversation grows cannot be split this way and is
    an error.
    """
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise DataError(f"{where}, {column}: expected a list of messages with a 'role' each, got {messages!r:.80}")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: column 'tools' is a string but not JSON ({e.msg})") from None
    said = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not said:
        raise DataError(f"{where}, {column}: no assistant message, nothing to learn")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: a conversation needs the tokenizer's chat template (it has none)")
    kwargs = {"tools": tools} if tools else {}

    def render(upto: int, generation: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=generation, tokenize=False,
                                                 **kwargs)
        except Exception as e:  # jinja errors of a template that rejects this conversation
            raise DataError(f"{where}: the tokenizer's chat template failed on this conversation "
                            f"({type(e).__name__}: {e})") from None

    eos = tokenizer.eos_token
    ids, mask, done = [], [], ""  # done: the text that ids stand for
    for k in said:
        before, through = render(k, True), render(k + 1, False)
        if not before.startswith(done) or not through.startswith(before) or eos not in through[len(before):]:
            raise DataError(f"{where}: the chat template does not render the conversation up to assistant message "
                            f"{k} as the text before it, the generation prompt, the message and {eos!r}, so the "
                            "assistant's tokens cannot be told apart")
        written = through[len(before):].rsplit(eos, 1)[0]  # the content, or the template's text of its tool_calls
        delta = tokenizer(before[len(done):], add_special_tokens=False)["input_ids"]
        turn = tokenizer(written, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += delta + turn
        mask += [0] * len(delta) + [1] * len(turn)
        done = before + written + eos
    return ids, mask
