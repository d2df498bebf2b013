"""verl's multi-turn command lines (tests/data/multiturn_scripts_2026_04): each loads with only its paths changed and
builds its tools, or fails at load with one message naming every reason; and the keys they needed act: a custom chat
template, a sampler class (a curriculum one updated each step), SGLang's tool-call format name, the rollout-server
keys and an empty value; the geo3k line trains multi-turn episodes of a vision-language model with verl's Geo3k
tool, and the DAPO line the ReTool recipe's code tool (a subclass of verl's SandboxFusionTool)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, config_warnings, hydra_config, load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "data" / "multiturn_scripts_2026_04"
OK = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]

# The scripts that do not load, each with fragments of its one message: every reason it gives (none now).
NOT_LOADING: dict[str, list[str]] = {}


def substitute(arg: str, model: str, data: str) -> str:
    """Only paths change: the model and data, the config folder and the files the scripts name in verl's checkout
    (or a recipe checkout) become this folder's copies and stand-ins."""
    key, eq, value = arg.partition("=")
    if eq and value.startswith("recipe/retool/"):  # the recipe scripts' paths, relative to a verl checkout
        arg = f"{key}={SCRIPTS / 'recipe_retool' / value.removeprefix('recipe/retool/')}"
    return (arg.replace("$MODEL_PATH", model).replace("$TRAIN_FILES", data).replace("$VAL_FILES", data)
            .replace("/path/to/verl/examples/sglang_multiturn/config", str(SCRIPTS / "config"))
            .replace("/path/to/verl/examples/sglang_multiturn/gsm8k_toolcall_shaping", str(SCRIPTS))
            .replace("/path/to/verl/recipe/retool", str(SCRIPTS / "recipe_retool"))
            .replace("pkg://tests.utils.dataset.test_create_rl_sampler_on_cpu", str(SCRIPTS / "samplers.py")))


def recorded(name: str, model: str, data: str) -> tuple[str, str | None, list[str]]:
    """(script, config file, overrides) of one recording with its paths changed."""
    record = json.loads((SCRIPTS / name).read_text())
    argv = [substitute(a, model, data) for a in record["argv"]]
    hydra = {a.split("=")[0]: a.split("=", 1)[1] for a in argv if a.startswith("--config-")}
    config_file, base = hydra_config(hydra.get("--config-path"), hydra.get("--config-name", "").strip("'"))
    return record["script"], config_file, base + [a for a in argv if not a.startswith("--config-")]


@pytest.fixture(scope="module")
def tools_data(tmp_path_factory) -> tuple[str, str]:
    """GSM8K in the tool-agent layout (`posttrain prepare gsm8k --tools`), standing in for every script's data."""
    from posttrain.data.preprocess import prepare

    written = prepare("gsm8k", None, tmp_path_factory.mktemp("gsm8k_tools"), tools=True)
    return str(written["train"][0]), str(written["test"][0])


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> str:
    """The geo3k scripts train Qwen2.5-VL: the tiny vision-language model stands in for it."""
    from posttrain.data.synthetic_visual import tokenizer_corpus
    from posttrain.models.tiny_vl import build_tiny_vl_model

    return str(build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"), tokenizer_corpus(), seed=0))


@pytest.fixture
def tracking_installed(monkeypatch):
    """As with `pip install 'posttrain[tracking]'`: the scripts log to wandb and mlflow."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("wandb", "mlflow") else real(name, *a))


@pytest.fixture
def verl_checkout(tmp_path, monkeypatch):
    """The current folder as a verl checkout with the recipes in `recipe/` (the recipe scripts run from there): the
    ReTool tool YAML's `recipe.retool.retool.CustomSandboxFusionTool` is the stand-in's class. The folder joins
    sys.path as the tool loader finds it; both are restored after."""
    (tmp_path / "checkout" / "recipe").mkdir(parents=True)
    (tmp_path / "checkout" / "recipe" / "retool").symlink_to(SCRIPTS / "recipe_retool", target_is_directory=True)
    monkeypatch.chdir(tmp_path / "checkout")
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path / "checkout"
    for name in [n for n in sys.modules if n == "recipe" or n.startswith("recipe.")]:
        del sys.modules[name]


def test_multiturn_scripts_load_or_name_every_reason(tiny_model_dir, tiny_vl_dir, tools_data, tracking_installed,
                                                     verl_checkout):
    """The 15 multi-turn example scripts and the 4 ReTool recipe scripts: the count docs/porting.md reports load,
    and each of the others fails with one message naming all its reasons. A line that loads also builds its tools
    (the tool YAML's classes, as the run builds them), so a line cannot load and then stop when its run starts."""
    from posttrain.agents.settings import AgentSettings
    from posttrain.tools.stateful import load_tool_config

    loaded, failed, built = [], {}, {}
    for path in sorted(SCRIPTS.glob("*.json")):
        model = tiny_vl_dir if path.name.startswith("geo3k__") else str(tiny_model_dir)
        script, config_file, overrides = recorded(path.name, model, tools_data[0])
        try:
            cfg = load_config(config_file, overrides)
            loaded.append(script)
        except ConfigError as e:
            failed[script] = str(e)
            continue
        settings = AgentSettings.from_config(cfg)
        if settings.tool_config_path:
            built[script] = [type(tool).__name__ for tool in load_tool_config(settings.tool_config_path)]
    assert set(built) == set(loaded)  # each sets a tool YAML
    assert {s for s, tools in built.items() if tools == ["CustomSandboxFusionTool"]} == {
        "run_qwen3_4b_dapo_multiturn.sh", "recipe/retool/run_gpt_oss_ppo.sh", "recipe/retool/run_qwen2-32b_dapo.sh",
        "recipe/retool/run_qwen2-32b_ppo.sh", "recipe/retool/run_qwen2_7b_dapo.sh"}  # the recipe's, over posttrain's
    examples = [s for s in loaded + list(failed) if not s.startswith("recipe/")]
    assert len(examples) == 15 and len(loaded) + len(failed) == 19
    assert set(failed) == set(NOT_LOADING), {s: failed.get(s) for s in set(failed) ^ set(NOT_LOADING)}
    for script, fragments in NOT_LOADING.items():
        for fragment in fragments:
            assert fragment in failed[script], (script, fragment, failed[script])
    count = sum(1 for s in loaded if not s.startswith("recipe/"))
    assert count == 15
    doc = (ROOT / "docs" / "porting.md").read_text()
    assert f"**{count} of 15 load" in doc and "**4 of the 4 ReTool recipe scripts load" in doc


def test_an_empty_value_of_a_bool_key_is_false_as_verl_reads_it(tiny_model_dir, tools_data, tracking_installed):
    """`use_kl_loss=${use_kl_loss}` with the variable unset passes `use_kl_loss=`: Hydra gives "", which verl's
    `if config.actor.use_kl_loss:` reads as False; posttrain reads False and says so. Other types stay refused."""
    cfg = load_config(None, OK + ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.use_kl_loss="])
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False
    assert "actor_rollout_ref.actor.use_kl_loss= -> False" in "\n".join(config_warnings(cfg))
    with pytest.raises(ConfigError, match="'data.max_prompt_length' expects int, got ''"):
        load_config(None, OK + ["data.max_prompt_length="])
    _, config_file, overrides = recorded("run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.json", str(tiny_model_dir),
                                         tools_data[0])
    assert "actor_rollout_ref.actor.use_kl_loss=" in overrides  # as recorded: the script's variable is never set
    assert load_config(config_file, overrides).actor_rollout_ref.actor.use_kl_loss is False


def test_sglang_tool_call_format_names_read_as_hermes(tiny_model_dir, tools_data, tracking_installed):
    """`multi_turn.format=qwen` (the search example's config file) is SGLang's parser name for the hermes format,
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>`; another format is refused with the reason."""
    from posttrain.agents.settings import AgentSettings

    _, config_file, overrides = recorded("search_r1_like__run_qwen2.5-3b_instruct_search_multiturn.json",
                                         str(tiny_model_dir), tools_data[0])
    cfg = load_config(config_file, overrides)
    assert AgentSettings.from_config(cfg).format == "hermes"
    assert "multi_turn.format=qwen -> hermes" in "\n".join(config_warnings(cfg))
    assert load_config(None, OK + ["actor_rollout_ref.rollout.multi_turn.format=qwen25"]
                       ).actor_rollout_ref.rollout.multi_turn.format == "hermes"
    with pytest.raises(ConfigError, match="format='pythonic': posttrain parses tool calls in the hermes format"):
        load_config(None, OK + ["actor_rollout_ref.rollout.multi_turn.format=pythonic"])


def test_the_search_r1_line_searches_its_retrieval_server(tiny_model_dir, tools_data, tmp_path, tracking_installed):
    """The search-r1 line's tool YAML, unchanged but for the server's address (a local retrieval server answering as
    verl's does), loads; the run's search tool sends verl's request (the YAML sets no topk: 3) and answers in verl's
    text. (With the recorded scripts' size knobs the line trains 2 steps on the tiny model in about 20 s, by hand.)"""
    from test_search_server import retrieval_server

    from posttrain.agents.settings import AgentSettings
    from posttrain.agents.tool_agent import toolbox_for
    from posttrain.tools import parse_tool_calls

    search_yaml = SCRIPTS / "config" / "tool_config" / "search_tool_config.yaml"
    with retrieval_server() as server:
        (tmp_path / "search.yaml").write_text(search_yaml.read_text().replace("http://127.0.0.1:8000/retrieve",
                                                                              server.url))
        _, config_file, overrides = recorded("search_r1_like__run_qwen2.5-3b_instruct_search_multiturn.json",
                                             str(tiny_model_dir), tools_data[0])
        overrides = [o.replace(str(search_yaml), str(tmp_path / "search.yaml")) for o in overrides]
        session = toolbox_for(AgentSettings.from_config(load_config(config_file, overrides))).open()
        call = '<tool_call>{"name": "search", "arguments": {"query_list": ["okapi"]}}</tool_call>'
        result, = session.run(parse_tool_calls(call).calls)
    assert result.error is None
    assert result.message["content"].startswith('{"result": "Doc 1 (Title: Okapi)\\nThe okapi is a mammal.\\n\\nDoc 2')
    assert [body for _, body in server.requests] == [{"queries": ["okapi"], "topk": 3, "return_scores": True}]
    (tmp_path / "search.yaml").write_text(search_yaml.read_text().replace(  # a corpus too: which one is meant?
        "retrieval_service_url:", "corpus_path: corpus.jsonl\n      retrieval_service_url:"))
    with pytest.raises(ConfigError, match="SearchTool: set exactly one of config.retrieval_service_url .* got both"):
        load_config(config_file, overrides)


def test_rollout_server_keys(tiny_model_dir, tools_data, tmp_path, tracking_installed):
    """verl's rollout-server keys (its client's request limit, retries, pool, start-up wait) load with a note: no
    request is sent here; with an agent program, whose requests do go to a server, they are refused with the reason.
    `sglang_rollout_mode` accepts SGLang's two modes only."""
    _, config_file, overrides = recorded("run_qwen2.5-3b_gsm8k_multiturn_server.json", str(tiny_model_dir),
                                         tools_data[0])
    notes = "\n".join(config_warnings(load_config(config_file, overrides)))
    for key in ("timeout", "max_attempts", "retry_delay", "max_connections", "max_start_wait_time"):
        assert f"actor_rollout_ref.rollout.server.{key}" in notes
    assert "no generation request is sent" in notes
    (tmp_path / "program.py").write_text("def play(row, base_url, api_key):\n    return 1.0\n")
    program = [f"actor_rollout_ref.rollout.agent.program={tmp_path / 'program.py'}:play",
               "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.server.timeout=60"]
    with pytest.raises(ConfigError, match="server.timeout with actor_rollout_ref.rollout.agent.program: the programs"):
        load_config(None, OK + program)
    assert load_config(None, OK + ["actor_rollout_ref.rollout.sglang_rollout_mode=engine"])
    with pytest.raises(ConfigError, match="sglang_rollout_mode='spmd' is not supported"):
        load_config(None, OK + ["actor_rollout_ref.rollout.sglang_rollout_mode=spmd"])


GEO3K_CONFIG = SCRIPTS / "config" / "geo3k_multiturn_grpo.yaml"


def test_custom_chat_template_renders_the_prompts(tiny_model_dir, tiny_vl_dir, tools_data, tmp_path,
                                                  tracking_installed):
    """The geo3k config file's `custom_chat_template` (a Qwen2.5-VL template: Qwen's tools block, a default system
    prompt) replaces the tokenizer's: the run's tokenizer, the prompts it encodes and the episode loop's rendering all
    use it, and a vision-language model's processor too; a template that does not compile is refused at load."""
    from test_porting import tiny_knobs

    from posttrain.agents.tool_agent import toolbox_for
    from posttrain.agents.settings import AgentSettings
    from posttrain.data.dataset import read_rows
    from posttrain.models.load import load_tokenizer
    from posttrain.models.vision import load_vision_processor
    from posttrain.trainer.rl import RLTrainer

    import yaml

    template = yaml.safe_load(GEO3K_CONFIG.read_text())["actor_rollout_ref"]["model"]["custom_chat_template"]
    tools = str(SCRIPTS / "config" / "tool_config" / "gsm8k_tool_config.yaml")
    cfg = load_config(str(GEO3K_CONFIG), [f"actor_rollout_ref.model.path={tiny_model_dir}",
                                          f"data.train_files={tools_data[0]}", f"data.val_files={tools_data[1]}",
                                          f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                                          *tiny_knobs(tmp_path / "run"), "data.train_max_samples=8",
                                          "data.max_prompt_length=2048",
                                          "actor_rollout_ref.rollout.prompt_length=2048"])
    assert cfg.actor_rollout_ref.model.custom_chat_template == template
    parts = RLTrainer(cfg).parts
    assert parts.tokenizer.chat_template == template and parts.episodes.tokenizer is parts.tokenizer
    own = load_tokenizer(str(tiny_model_dir))
    row = read_rows(tools_data[0])[parts.train_data.items[0].extra_info["index"]]
    schemas = toolbox_for(AgentSettings.from_config(cfg)).schemas()
    rendered = own.apply_chat_template(list(row["prompt"]), tools=schemas, chat_template=template,
                                       add_generation_prompt=True, tokenize=False)
    assert "You may call one or more functions to assist with the user query." in rendered  # its tools block
    assert parts.train_data.items[0].prompt_ids == own(rendered, add_special_tokens=False)["input_ids"]
    assert parts.train_data.items[0].prompt_ids != own.apply_chat_template(
        list(row["prompt"]), tools=schemas, add_generation_prompt=True, tokenize=True)
    vl_tok = load_tokenizer(tiny_vl_dir, chat_template=template)
    processor = load_vision_processor(tiny_vl_dir, vl_tok, chat_template=template)
    messages = [{"role": "user", "content": "two plus two"}]
    ids, _ = processor.encode(messages, [])
    assert ids == vl_tok(vl_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]
    assert "You are a helpful assistant." in vl_tok.decode(ids)
    if processor.processor is not None:
        assert processor.processor.chat_template == template
    with pytest.raises(ConfigError, match="custom_chat_template: is not a Jinja template transformers can compile"):
        load_config(None, OK + ["actor_rollout_ref.model.custom_chat_template='{% for m in messages %}'"])


def geo3k_rows(path: Path, n: int) -> str:
    """Rows in the layout of verl's examples/data_preprocess/geo3k_multiturn_w_tool.py (its system prompt, the
    problem with its `<image>` and the instruction, the image, the ground truth in the tool's create_kwargs), with
    drawn figures standing in for Geometry3K's."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageDraw

    from posttrain.data.preprocess.geo3k import INSTRUCTION

    system = ("You are a math expert. You are given a question and you need to solve it step by step. Reasoning step "
              "by step before any tool call. You should use the `calc_geo3k_reward` tool after step by step solving "
              "the question, before generate final answer at least once and refine your answer if necessary. ")
    rows = []
    for k in range(n):
        image = Image.new("RGB", (56, 56), "white")
        ImageDraw.Draw(image).polygon([(4, 50), (50, 50), (4 + 5 * k, 6)], outline="black")
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        problem, answer = f"<image>Find x. Side {k + 3}.", str(2 * k + 3)
        rows.append({"data_source": "hiyouga/geometry3k", "prompt": [
            {"role": "system", "content": system}, {"role": "user", "content": problem + " " + INSTRUCTION}],
            "images": [{"bytes": buf.getvalue(), "path": None}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": k, "answer": answer, "question": problem,
                           "need_tools_kwargs": True,
                           "tools_kwargs": {"calc_geo3k_reward": {"create_kwargs": {"ground_truth": answer}}}}})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_the_geo3k_line_trains_vl_episodes_with_verls_geo3k_tool(tiny_vl_dir, tmp_path, tracking_installed):
    """The recorded geo3k line (Qwen2.5-VL, its custom chat template, the Geo3k tool YAML) with only paths changed,
    on the tiny vision-language model over rows of verl's geo3k multi-turn layout: it trains 2 steps with the recorded
    scripts' size knobs (prompts of up to 2048 tokens, the script's own value: the tools block takes about 1200 of the
    tiny tokenizer's); the prompts are rendered with the tool schema and carry their images into the episodes; and
    the YAML's tool, called as an episode calls it with the row's tools_kwargs, grades the answer as verl's does."""
    from test_porting import tiny_knobs, trained_steps

    from posttrain.agents.settings import AgentSettings
    from posttrain.agents.tool_agent import ToolAgent
    from posttrain.agents.episode import Episode
    from posttrain.models.vision import MM_KEY
    from posttrain.tools.builtin.geo3k import Geo3kTool
    from posttrain.trainer.rl import RLTrainer

    data = geo3k_rows(tmp_path / "geo3k.parquet", 8)
    _, config_file, overrides = recorded("geo3k__run_qwen2.5-3b_geo3k_multiturn.json", tiny_vl_dir, data)
    cfg = load_config(config_file, overrides + tiny_knobs(tmp_path / "run") + [
        "data.max_prompt_length=2048", "actor_rollout_ref.rollout.prompt_length=2048"])
    trainer = RLTrainer(cfg)
    item = trainer.parts.train_data.items[0]
    tokenizer = trainer.parts.tokenizer
    assert item.images is not None and '"name": "calc_geo3k_reward"' in tokenizer.decode(item.prompt_ids)
    agent = ToolAgent(AgentSettings.from_config(cfg))
    assert isinstance(agent.toolbox.tools["calc_geo3k_reward"], Geo3kTool)
    row = {"raw_prompt": item.raw_prompt, "extra_info": item.extra_info, MM_KEY: item.images}
    start = agent.reset(row)
    episode = Episode(prompt_ids=[], messages=start.messages + [{"role": "assistant", "content": (
        '<tool_call>\n{"name": "calc_geo3k_reward", "arguments": {"answer": "' + str(item.ground_truth) +
        '"}}\n</tool_call>')}])
    step = agent.step(episode)
    assert [m["content"] for m in step.messages] == [f"Current parsed answer='{item.ground_truth}' reward=1.0"]
    assert episode.tool_reward == 0.0  # a better answer than none: no penalty
    agent.close()
    trainer.fit()
    trained_steps(tmp_path / "run")


REVERSED = '''
from verl.experimental.dataset.sampler import AbstractSampler


class Reversed(AbstractSampler):
    """The prompts last to first."""

    def __init__(self, data_source, data_config):
        self.n = len(data_source)

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class OutOfRange(Reversed):
    def __iter__(self):
        return iter([self.n + 5] * self.n)
'''


def sampler_cfg(path, name, *more):
    return load_config(None, OK + [f"data.sampler.class_path={path}", f"data.sampler.class_name={name}", *more])


def test_a_sampler_class_orders_the_prompts_the_same_on_every_rank(tmp_path):
    """`data.sampler.class_path/class_name` load a class as verl's create_rl_sampler does (verl's sampler interfaces
    import without verl), and its indices are the prompts drawn, `train_batch_size` at a time, an epoch per
    iteration; a resumed run replays them; a sampler drawing from torch's global generator (the recorded scripts'
    RandomCurriculumSampler) gives every process the same indices whatever their generators' states; problems are
    named at load."""
    from posttrain.data.dataset import epoch_batches
    from posttrain.data.sampler import PromptOrder

    (tmp_path / "mine.py").write_text(REVERSED)
    cfg = sampler_cfg(f"file://{tmp_path / 'mine.py'}", "Reversed", "data.train_batch_size=4",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    order = PromptOrder(list(range(10)), cfg.data, 4)
    assert order.batches_per_epoch == 2
    assert [order.batch(c) for c in range(3)] == [[9, 8, 7, 6], [5, 4, 3, 2], [9, 8, 7, 6]]
    assert PromptOrder(list(range(10)), cfg.data, 4).batch(1) == [5, 4, 3, 2]  # a resumed run
    plain = load_config(None, OK).data
    assert PromptOrder(list(range(10)), plain, 4).batch(1) == list(epoch_batches(10, 4, shuffle=True, seed=1,
                                                                                 epoch=0))[1]
    recorded_sampler = sampler_cfg(SCRIPTS / "samplers.py", "RandomCurriculumSampler").data
    draws = []
    for rank_seed in (0, 1):  # two processes whose generators have drawn differently
        torch.manual_seed(rank_seed)
        torch.rand(rank_seed + 3)
        order = PromptOrder(list(range(32)), recorded_sampler, 8)
        draws.append([order.batch(c) for c in range(5)])
    assert draws[0] == draws[1] and sorted(sum(draws[0][:4], [])) == list(range(32))
    assert draws[0][4] != draws[0][0]  # the next epoch is another order
    assert PromptOrder(list(range(32)), recorded_sampler, 8).batch(3) == draws[0][3]
    with pytest.raises(ValueError, match=r"OutOfRange gave \[15, 15, 15\], not indices of the 10 training prompts"):
        PromptOrder(list(range(10)), sampler_cfg(tmp_path / "mine.py", "OutOfRange").data, 4).batch(0)
    with pytest.raises(ConfigError, match="mine.py has no 'Nope'"):
        sampler_cfg(tmp_path / "mine.py", "Nope")
    with pytest.raises(ConfigError, match="no file .*missing.py"):
        sampler_cfg(tmp_path / "missing.py", "Reversed")
    with pytest.raises(ConfigError, match="class_path and data.sampler.class_name name a sampler class together"):
        load_config(None, OK + ["data.sampler.class_name=Reversed"])
    with pytest.raises(ConfigError, match="RandomCurriculumSampler is a curriculum sampler .* asynchronous RL"):
        sampler_cfg(SCRIPTS / "samplers.py", "RandomCurriculumSampler", "rollout.n_gpus_per_node=1")


CURRICULUM = '''
import json
import os

from verl.experimental.dataset.sampler import AbstractCurriculumSampler


class Blocks(AbstractCurriculumSampler):
    """Prompts in blocks of 4, block k drawn after k updates (so a draw made before the step's update would show);
    each draw and each update is written to the file $SAMPLER_RECORD."""

    def __init__(self, data_source, data_config):
        self.prompts, self.updates = data_source, 0
        self.record = os.environ["SAMPLER_RECORD"]

    def __len__(self):
        return len(self.prompts)

    def __iter__(self):
        for _ in range(len(self) // 4):
            block = [(4 * self.updates + j) % len(self) for j in range(4)]
            self._write({"drawn": block, "ground_truth": [str(self.prompts[i].ground_truth) for i in block]})
            yield from block

    def update(self, batch):
        self.updates += 1
        self._write({"rows": len(batch), "uid": sorted(set(batch.non_tensor_batch["uid"])),
                     "ground_truth": sorted(set(map(str, batch.non_tensor_batch["ground_truth"]))),
                     "tensors": sorted(batch.batch), "index": [int(i) for i in batch.non_tensor_batch["index"]]})

    def _write(self, entry):
        with open(self.record, "a") as f:
            f.write(json.dumps(entry) + "\\n")
'''


def test_a_curriculum_sampler_is_updated_with_each_trained_batch(tiny_model_dir, tools_data, tmp_path, monkeypatch,
                                                                 tracking_installed):
    """The recorded curriculum script with its paths changed and the recorded scripts' size knobs, its sampler class
    replaced by one that draws block k of prompts after k updates: 2 steps train on the blocks it chose (not the
    seeded shuffle's), and `update` gets each step's whole scored batch (4 prompts x 2 samples, advantages
    computed) before the next draw."""
    from test_porting import tiny_knobs, trained_steps

    from posttrain.trainer.rl import run_rl

    (tmp_path / "blocks.py").write_text(CURRICULUM)
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("SAMPLER_RECORD", str(record))
    _, config_file, overrides = recorded("run_qwen0.5b_gsm8k_multiturn_curriculum.json", str(tiny_model_dir),
                                         tools_data[0])
    assert "data.sampler.class_name=RandomCurriculumSampler" in overrides
    cfg = load_config(config_file, overrides + tiny_knobs(tmp_path / "run") + [
        "data.train_max_samples=16", f"data.sampler.class_path={tmp_path / 'blocks.py'}",
        "data.sampler.class_name=Blocks"])
    run_rl(cfg)
    trained_steps(tmp_path / "run")
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    draws = [e for e in entries if "drawn" in e]
    updates = [e for e in entries if "rows" in e]
    assert [e["drawn"] for e in draws] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the second block: after one update
    assert ["drawn" in e for e in entries] == [True, False, True, False]  # draw, update, draw, update
    assert len(updates) == 2 and all(u["rows"] == 8 and len(u["uid"]) == 4 for u in updates)
    for draw, update in zip(draws, updates):
        assert sorted(set(draw["ground_truth"])) == update["ground_truth"]
        assert {"advantages", "responses", "response_mask", "token_level_scores"} <= set(update["tensors"])


def test_the_dapo_multiturn_line_runs_the_recipes_code_tool(tiny_model_dir, tools_data, tmp_path, monkeypatch,
                                                            verl_checkout, tracking_installed):
    """The recorded DAPO multi-turn line (the ReTool recipe's dataset class, reward and tool YAML), its paths
    changed and the YAML's server address that of a local `posttrain sandbox-server`: the YAML's class is the
    recipe's CustomSandboxFusionTool over posttrain's SandboxFusionTool; called as an episode calls it, it takes the
    code out of its fence, prints its last line and runs it on that server (posttrain's sandbox); and the line trains
    2 steps with the recorded scripts' size knobs."""
    import threading

    from test_porting import tiny_knobs, trained_steps

    from posttrain.agents.episode import Episode
    from posttrain.agents.settings import AgentSettings
    from posttrain.agents.tool_agent import ToolAgent
    from posttrain.reward import sandbox_server
    from posttrain.trainer.rl import RLTrainer

    if not sandbox_server.sandbox_status()[0]:
        pytest.skip("no bubblewrap sandbox on this machine")
    ran = []
    real_run = sandbox_server.run_program
    monkeypatch.setattr(sandbox_server, "run_program",
                        lambda code, *a, **k: ran.append(code) or real_run(code, *a, **k))
    server = sandbox_server.SandboxServer(("127.0.0.1", 0), max_workers=2)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tool_yaml = SCRIPTS / "recipe_retool" / "sandbox_fusion_tool_config.yaml"
    (tmp_path / "tools.yaml").write_text(tool_yaml.read_text().replace(
        "http://localhost:8080/run_code", f"http://127.0.0.1:{server.server_address[1]}/run_code"))
    try:
        _, config_file, overrides = recorded("run_qwen3_4b_dapo_multiturn.json", str(tiny_model_dir), tools_data[0])
        assert "data.custom_cls.name=CustomRLHFDataset" in overrides
        overrides = [o.replace(str(tool_yaml), str(tmp_path / "tools.yaml")) for o in overrides]
        cfg = load_config(config_file, overrides + tiny_knobs(tmp_path / "run") + [
            "data.train_max_samples=8", "data.val_max_samples=4"])
        trainer = RLTrainer(cfg)
        item = trainer.parts.train_data.items[0]
        assert "The answer format must be" in trainer.parts.tokenizer.decode(item.prompt_ids)  # the recipe's map_fn2
        agent = ToolAgent(AgentSettings.from_config(cfg))
        tool = agent.toolbox.tools["code_interpreter"]
        assert [c.__name__ for c in type(tool).__mro__[:2]] == ["CustomSandboxFusionTool", "SandboxFusionTool"]
        start = agent.reset({"raw_prompt": item.raw_prompt, "extra_info": item.extra_info})
        call = {"name": "code_interpreter", "arguments": {"code": "```python\nx = 6 * 7\nx + 1\n```"}}
        episode = Episode(prompt_ids=[], messages=start.messages + [
            {"role": "assistant", "content": f"<tool_call>\n{json.dumps(call)}\n</tool_call>"}])
        step = agent.step(episode)
        agent.close()
        assert [m["content"] for m in step.messages] == ["43\n"]
        assert ran == ["x = 6 * 7\nprint(x + 1)"]  # out of its fence, the last line printed, on the YAML's server
        assert episode.tool_calls == 1 and not episode.tool_errors
        trainer.fit()
        trained_steps(tmp_path / "run")
    finally:
        server.shutdown()
        server.server_close()
