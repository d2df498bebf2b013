"""RL / SFT datasets: layout, chat template, truncation, filtering, and errors that name file, row and column."""

import json

import pytest

from posttrain.data.batch import Batch
from posttrain.data.dataset import DataError, RLDataset, SFTDataset, collate_prompts, epoch_batches, read_rows
from posttrain.data.synthetic import add_without_carry, rl_row, split_pairs


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_jsonl_and_parquet_give_same_prompts(tmp_path, tiny_tokenizer):
    rows = [rl_row(12, 34, "train", 0), rl_row(56, 78, "train", 1)]
    a = RLDataset(write_jsonl(tmp_path / "a.jsonl", rows), tiny_tokenizer)
    b = RLDataset([write_parquet(tmp_path / "b.parquet", rows)], tiny_tokenizer)
    assert [it.prompt_ids for it in a.items] == [it.prompt_ids for it in b.items]
    expected = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True,
                                                  tokenize=False)
    assert tiny_tokenizer.decode(a[0].prompt_ids) == expected
    assert a[1].ground_truth == "134" and a[0].data_source == "synthetic/arithmetic"


def test_bad_rows_name_file_row_and_column(tmp_path, tiny_tokenizer):
    good = rl_row(1, 2, "train", 0)
    path = write_jsonl(tmp_path / "x.jsonl", [good, {k: v for k, v in good.items() if k != "prompt"}])
    with pytest.raises(DataError, match=r"x.jsonl: row 1: missing column 'prompt'"):
        RLDataset(path, tiny_tokenizer)
    path = write_jsonl(tmp_path / "y.jsonl", [good, {**good, "prompt": 5}])
    with pytest.raises(DataError, match=r"y.jsonl: row 1, column 'prompt'"):
        RLDataset(path, tiny_tokenizer)
    path = write_jsonl(tmp_path / "z.jsonl", [{**good, "reward_model": {"style": "rule"}}])
    with pytest.raises(DataError, match=r"z.jsonl: row 0: column 'reward_model'"):
        RLDataset(path, tiny_tokenizer)
    (tmp_path / "bad.jsonl").write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl: row 1 \(line 2\) is not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="file not found"):
        read_rows(tmp_path / "missing.parquet")
    with pytest.raises(DataError, match="unsupported file type"):
        read_rows(write_jsonl(tmp_path / "w.csv", [good]))


def test_truncation_and_filtering(tmp_path, tiny_tokenizer):
    long_row = {**rl_row(1, 2, "train", 0), "prompt": [{"role": "user", "content": "1+2= " * 60}]}
    path = write_jsonl(tmp_path / "l.jsonl", [long_row, rl_row(3, 4, "train", 1)])
    with pytest.raises(DataError, match=r"l.jsonl: row 0: prompt has \d+ tokens > data.max_prompt_length=40"):
        RLDataset(path, tiny_tokenizer, max_prompt_length=40)
    kept = RLDataset(path, tiny_tokenizer, max_prompt_length=40, filter_overlong_prompts=True)
    assert len(kept) == 1 and kept.num_filtered == 1
    full = RLDataset(path, tiny_tokenizer, max_prompt_length=1000)[0].prompt_ids
    left = RLDataset(path, tiny_tokenizer, max_prompt_length=40, truncation="left")[0].prompt_ids
    right = RLDataset(path, tiny_tokenizer, max_prompt_length=40, truncation="right")[0].prompt_ids
    middle = RLDataset(path, tiny_tokenizer, max_prompt_length=40, truncation="middle")[0].prompt_ids
    assert left == full[-40:] and right == full[:40] and middle == full[:20] + full[-20:]


# A chat template that lists the offered tools' names in a system turn before the conversation (as Qwen's lists
# their schemas), so what `tools=` adds to a prompt can be written out here.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for t in tools %}{{- t['function']['name'] + ';' }}"
    "{%- endfor %}{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SCHEMAS = [{"type": "function", "function": {"name": name, "description": f"{name} two numbers",
                                              "parameters": {"type": "object", "properties": {}}}}
           for name in ("add", "mul")]


def test_prompts_carry_tool_schemas_agent_name_and_tools_kwargs(tmp_path, tiny_tokenizer):
    """Prompts of multi-turn runs are encoded with the offered tools' schemas, so prompt lengths and the overlong
    filter count them; each item names its row's environment (agent_name, None when the row has none), and
    extra_info.tools_kwargs keeps only the tools the row names (parquet pads the others with null)."""
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TOOLS_TEMPLATE
    rows = [{**rl_row(12, 34, "train", 0), "agent_name": "tool_agent",
             "extra_info": {"index": 0, "tools_kwargs": {"add": {"create_kwargs": {"ground_truth": "46"}}}}},
            {**rl_row(1, 2, "train", 1), "agent_name": None,
             "extra_info": {"index": 1, "tools_kwargs": {"mul": {"create_kwargs": {"ground_truth": "3"}}}}}]
    path = write_parquet(tmp_path / "t.parquet", rows)
    data = RLDataset(path, tok, tools=SCHEMAS)
    assert tok.decode(data[0].prompt_ids) == ("<|im_start|>system\n<tools>add;mul;</tools><|im_end|>\n"
                                              "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n")
    assert [it.agent_name for it in data] == ["tool_agent", None] and not data.notes
    assert data[0].extra_info["tools_kwargs"] == {"add": {"create_kwargs": {"ground_truth": "46"}}}
    assert data[1].extra_info["tools_kwargs"] == {"mul": {"create_kwargs": {"ground_truth": "3"}}}
    plain = RLDataset(path, tok)
    assert tok.decode(plain[0].prompt_ids) == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    longest = max(len(it.prompt_ids) for it in plain)
    assert len(RLDataset(path, tok, max_prompt_length=longest, filter_overlong_prompts=True)) == 2
    with pytest.raises(DataError, match="dropped all 2 rows"):
        RLDataset(path, tok, tools=SCHEMAS, max_prompt_length=longest, filter_overlong_prompts=True)
    # a row without the column at all has no environment of its own either
    bare = write_jsonl(tmp_path / "n.jsonl", [rl_row(5, 6, "train", 0)])
    assert RLDataset(bare, tok, tools=SCHEMAS)[0].agent_name is None


def test_bad_tool_rows_and_templates_are_named(tmp_path, tiny_tokenizer):
    good = rl_row(1, 2, "train", 0)
    with pytest.raises(DataError, match=r"a.jsonl: row 0, column 'agent_name': expected the name of an environment"):
        RLDataset(write_jsonl(tmp_path / "a.jsonl", [{**good, "agent_name": 5}]), tiny_tokenizer)
    unknown = write_jsonl(tmp_path / "u.jsonl", [good, {**good, "agent_name": "tool_agnet"}])
    with pytest.raises(DataError, match=r"u.jsonl: row 1, column 'agent_name': no environment is registered as "
                                        r"'tool_agnet' \(registered: single_turn_agent, tool_agent\)"):
        RLDataset(unknown, tiny_tokenizer, agent_names={"tool_agent", "single_turn_agent"})
    assert RLDataset(unknown, tiny_tokenizer)[1].agent_name == "tool_agnet"  # a single-turn run does not read it
    bad_kwargs = {**good, "extra_info": {"tools_kwargs": {"add": "ground_truth=3"}}}
    with pytest.raises(DataError, match=r"k.jsonl: row 0, column 'extra_info': 'tools_kwargs' must map each tool"):
        RLDataset(write_jsonl(tmp_path / "k.jsonl", [bad_kwargs]), tiny_tokenizer)
    path = write_jsonl(tmp_path / "g.jsonl", [good])
    ignores = RLDataset(path, tiny_tokenizer, tools=SCHEMAS)  # its template has no place for tools
    assert any("does not render tools=" in note for note in ignores.notes)
    assert ignores[0].prompt_ids == RLDataset(path, tiny_tokenizer)[0].prompt_ids
    import copy

    untemplated = copy.deepcopy(tiny_tokenizer)
    untemplated.chat_template = None
    with pytest.raises(DataError, match="tokenizer has none"):
        RLDataset(path, untemplated, tools=SCHEMAS, missing_chat_template="join")


def test_epoch_batches_are_seeded_and_disjoint():
    a = list(epoch_batches(10, 3, shuffle=True, seed=1, epoch=0))
    assert a == list(epoch_batches(10, 3, shuffle=True, seed=1, epoch=0))
    assert a != list(epoch_batches(10, 3, shuffle=True, seed=1, epoch=1))
    flat = [i for b in a for i in b]
    assert len(a) == 3 and len(set(flat)) == 9


def test_collate_left_pads_and_batch_ops():
    from posttrain.data.dataset import PromptItem

    ids, mask = collate_prompts([PromptItem([5, 6, 7], "s", "1"), PromptItem([8], "s", "2")], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    b = Batch({"x": ids}, {"uid": ["a", "b"]}).repeat_interleave(2)
    assert b.meta["uid"] == ["a", "a", "b", "b"] and len(b) == 4 and b["x"][2].tolist() == [0, 0, 8]
    assert Batch.concat([b, b]).meta["uid"] == ["a", "a", "b", "b"] * 2


def test_sft_dataset_masks_response_only(tmp_path, tiny_tokenizer):
    row = {**rl_row(12, 34, "train", 0), "response": "#### 46"}
    data = SFTDataset(write_jsonl(tmp_path / "s.jsonl", [row]), tiny_tokenizer)
    ids, attn, loss = data.collate([0], tiny_tokenizer.pad_token_id)
    response = tiny_tokenizer.decode(ids[0][loss[0].bool()])
    assert response == "#### 46" + tiny_tokenizer.eos_token
    with pytest.raises(DataError, match="missing column 'response'"):
        SFTDataset(write_jsonl(tmp_path / "t.jsonl", [rl_row(1, 2, "x", 0)]), tiny_tokenizer)


@pytest.fixture(scope="module")
def tool_tokenizer():
    from posttrain.data.synthetic_tools import tokenizer_corpus
    from posttrain.models.tiny import build_tokenizer

    return build_tokenizer(tokenizer_corpus(0, 200), tools=True)


def test_sft_conversation_learns_assistant_tokens_only(tmp_path, tool_tokenizer):
    """A multi-turn conversation with tool turns trains on each assistant turn's content and EOS only: the system,
    user and tool messages and the template's own tokens (role headers, the newline after EOS) have loss mask 0,
    and the ids are the pieces a rollout would hold, in order."""
    tok = tool_tokenizer
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
    row = {"messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "12*34="},
                        {"role": "assistant", "content": call}, {"role": "tool", "content": "408"},
                        {"role": "assistant", "content": "408"}, {"role": "user", "content": "thanks"}],
           "tools": json.dumps([{"type": "function", "function": {
               "name": "calculator", "parameters": {"type": "object", "properties": {"expression": {}}}}}])}
    pieces = [  # (text, learned), written out by hand from the template's layout
        ("<|im_start|>system\nBe exact.\nTools: calculator(expression)<|im_end|>\n<|im_start|>user\n12*34=<|im_end|>"
         "\n<|im_start|>assistant\n", 0),
        (call, 1), (tok.eos_token, 1),
        ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n", 0),
        ("408", 1), (tok.eos_token, 1)]  # the trailing user turn teaches nothing and is left out
    expected_ids, expected_mask = [], []
    for text, learned in pieces:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        expected_ids += ids
        expected_mask += [learned] * len(ids)
    data = SFTDataset(write_jsonl(tmp_path / "c.jsonl", [row]), tok)
    assert data.examples[0] == (expected_ids, expected_mask)
    ids, attn, loss = data.collate([0], tok.pad_token_id)
    assert ids[0].tolist() == expected_ids and loss[0].tolist() == expected_mask and attn[0].all()
    assert tok.decode(ids[0][loss[0].bool()]) == call + tok.eos_token + "408" + tok.eos_token


def test_sft_conversation_with_tool_calls_field_learns_its_rendering(tmp_path, tool_tokenizer):
    """An assistant message given as `tool_calls` (no content) trains on the template's text of the call."""
    tok = tool_tokenizer
    row = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}]}]}
    ids, mask = SFTDataset(write_jsonl(tmp_path / "c.jsonl", [row]), tok).examples[0]
    learned = tok.decode([t for t, m in zip(ids, mask) if m])
    assert learned == '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call><|im_end|>'


def test_sft_conversation_errors(tmp_path, tool_tokenizer, tiny_tokenizer):
    with pytest.raises(DataError, match="row 0, column 'messages': no assistant message"):
        SFTDataset(write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}]),
                   tool_tokenizer)
    with pytest.raises(DataError, match="row 0, column 'messages': expected a list of messages"):
        SFTDataset(write_jsonl(tmp_path / "b.jsonl", [{"messages": "hi"}]), tool_tokenizer)
    long = {"messages": [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2" * 50}]}
    with pytest.raises(DataError, match="tokens > max_length=20"):
        SFTDataset(write_jsonl(tmp_path / "c.jsonl", [long]), tool_tokenizer, max_length=20)
    data = SFTDataset(write_jsonl(tmp_path / "d.jsonl", [long]), tool_tokenizer, max_length=20, truncation="right")
    ids, mask = data.examples[0]
    assert len(ids) == 20 and mask[-1] == 1


def test_synthetic_task():
    assert add_without_carry(47, 38) == 75 and add_without_carry(75, 48) == 13 and add_without_carry(12, 34) == 46
    train, dev, test = split_pairs(0)
    assert not set(train) & set(test) and not set(dev) & set(test) and len(test) == 300
