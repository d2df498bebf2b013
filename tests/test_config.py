"""Config tree: override parsing, YAML round trip, every rejection named in the spec, CLI print-config."""

import dataclasses
import subprocess
import sys

import pytest
import yaml

from posttrain.config import ConfigError, all_keys, load_config, parse_override, to_yaml

OK = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def rejects(overrides, *fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("text,expected", [
    ("True", True), ("False", False), ("true", True), ("null", None), ("5", 5), ("1e-6", "1e-6"), ("0.5", 0.5),
    ("['console','tensorboard']", ["console", "tensorboard"]), ('["console","wandb"]', ["console", "wandb"]),
    ("abc", "abc"), ("", ""),
])
def test_parse_value(text, expected):
    assert parse_override(f"a.b={text}") == ("a.b", expected)


def test_plus_prefix_and_defaults():
    cfg = load_config(None, ["+trainer.val_before_train=False", "actor_rollout_ref.actor.optim.lr=1e-6"])
    assert cfg.trainer.val_before_train is False
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl" and cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0
    assert cfg.critic.optim.lr == pytest.approx(1e-5) and cfg.data.train_batch_size == 1024


def test_typical_command_line_is_accepted(tmp_path, monkeypatch, tiny_model_dir):
    """verl's quickstart line on one GPU, where vLLM is installed (the check finds the module, it does not import
    it): accepted, with at most the note that free_cache_engine does nothing on a CPU."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.parquet").write_bytes(b"")
    line = """algorithm.adv_estimator=grpo data.train_files=['a.parquet','b.parquet'] data.val_files=['c.parquet']
    data.train_batch_size=1024 data.max_prompt_length=1024 data.max_response_length=1024
    data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=MODEL
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","tensorboard"]
    trainer.project_name=grpo_example trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=1
    trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15"""
    cfg = load_config(None, line.replace("MODEL", str(tiny_model_dir)).split())
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.actor_rollout_ref.rollout.n == 5 and cfg.trainer.logger == ["console", "tensorboard"]
    from posttrain.config import config_warnings

    notes = config_warnings(cfg)
    assert len(notes) <= 1 and all("free_cache_engine=True does nothing on a CPU" in n for n in notes), notes


def test_unknown_key_suggests_closest():
    rejects(["actor_rollout_ref.actor.use_kl_los=True"], "use_kl_los'", "Did you mean 'actor_rollout_ref.actor.use_kl_loss'")
    rejects(["algorithm.adv_estimater=grpo"], "algorithm.adv_estimator")
    rejects(["trainer.nonsense.deep=1"], "unknown config key 'trainer.nonsense.deep'")


def test_unsupported_keys_say_what_to_use():
    rejects(["actor_rollout_ref.actor.ppo_micro_batch_size=4"], "not supported", "ppo_micro_batch_size_per_gpu")
    rejects(["actor_rollout_ref.actor.strategy=deepspeed"], "strategy='deepspeed' is not one of")
    rejects(["reward_model.enable=True"], "reward_model.enable=True needs reward_model.model.path")
    rejects(["reward_model.launch_reward_fn_async=True"], "not supported")
    rejects(["algorithm.use_pf_ppo=True"], "is not supported", "PF-PPO")


def test_sequence_parallel_layout_is_checked():
    """ulysses_sequence_parallel_size loads where it runs (dp = world / sp, every role on the actor's layout) and is
    refused with its reason where it does not: with tensor parallel, with fsdp_size, padded rows, another size for
    ref or critic, a size that does not divide the processes; verl's newer fsdp_config key sets the role's."""
    sp = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
    ok = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=4",
          f"{sp}=2"]
    cfg = load_config(None, ok + ["actor_rollout_ref.ref.ulysses_sequence_parallel_size=2"])
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    rejects(ok + ["actor_rollout_ref.actor.fsdp_config.tp_size=2"], "tp_size=2: not supported", "use one of them")
    rejects(ok + ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2"], "fsdp_size=2: not supported")
    rejects(ok + ["actor_rollout_ref.model.use_remove_padding=False"], "use_remove_padding=True")
    rejects(ok + ["critic.model.use_remove_padding=False"], "critic.model.use_remove_padding=True")
    rejects(ok + ["critic.ulysses_sequence_parallel_size=4"], "critic.ulysses_sequence_parallel_size=4",
            "actor's sequence-parallel layout")
    rejects(ok[:-1] + [f"{sp}=3"], "ulysses_sequence_parallel_size=3 must divide the 4 processes")
    # verl counts fsdp_size over every rank: all of them with sequence parallel is one shard group (posttrain's -1)
    whole = load_config(None, ok + ["actor_rollout_ref.actor.fsdp_config.fsdp_size=4"])
    assert whole.actor_rollout_ref.actor.fsdp_config.fsdp_size == -1
    # the newest verl tree's place for the key (the role's own is deprecated there) sets the role's key
    newer = load_config(None, ok[:-1] + ["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"])
    assert newer.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2


def test_process_layout_is_checked():
    """Multi-process settings load; layouts that cannot split the responses evenly over the ranks are rejected."""
    ok = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    cfg = load_config(None, ok + ["trainer.nnodes=2", "trainer.n_gpus_per_node=4",
                                  "actor_rollout_ref.actor.fsdp_config.tp_size=2",
                                  "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
                                  "actor_rollout_ref.actor.fsdp_config.param_offload=True"])
    assert cfg.trainer.nnodes == 2 and cfg.actor_rollout_ref.actor.fsdp_config.tp_size == 2
    assert load_config(None, ok + ["trainer.n_gpus_per_node=2", "actor_rollout_ref.model.lora_rank=8"])
    # fewer prompts than ranks: a prompt's samples are split over ranks, evenly
    assert load_config(None, ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                              "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=4"])
    rejects(ok + ["trainer.n_gpus_per_node=3"], "data.train_batch_size=16 x rollout.n=1 responses must be divisible "
            "by the 3 data-parallel ranks")
    rejects(["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.n_gpus_per_node=4",
             "actor_rollout_ref.rollout.n=1"], "ppo_mini_batch_size=2 x rollout.n=1 responses must be divisible by the 4")
    rejects(["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.n_gpus_per_node=4",
             "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=True"],
            "data.train_batch_size=2 must be divisible by the 4 data-parallel ranks")
    # fewer prompts per mini-batch than ranks: a group straddles two ranks (its responses split evenly)
    assert load_config(None, ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                              "trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.n=2"])
    rejects(ok + ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.fsdp_config.tp_size=3"],
            "tp_size=3 must divide the 4 processes")
    rejects(ok + ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.fsdp_config.fsdp_size=3"],
            "fsdp_size=3 must divide the 4 data-parallel ranks")
    rejects(ok + ["actor_rollout_ref.ref.fsdp_config.fsdp_size=4"], "ref.fsdp_config.fsdp_size=4", "actor's sharding")
    rejects(ok + ["critic.model.fsdp_config.tp_size=2"], "critic.model.fsdp_config.tp_size=2", "actor's tensor")
    rejects(ok + ["actor_rollout_ref.actor.fsdp_config.model_dtype=fp8"], "model_dtype='fp8'")
    rejects(ok + ["actor_rollout_ref.model.lora_rank=-1"], "lora_rank must be >= 0")
    rejects(ok + ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.tp_size=2",
                  "actor_rollout_ref.model.lora_rank=8"], "LoRA runs with FSDP2 sharding alone")
    rejects(ok + ["actor_rollout_ref.actor.grad_clip=-1"], "grad_clip=-1.0 must be positive")
    rejects(ok + ["actor_rollout_ref.actor.checkpoint.save_contents=['model','weights']"], "'weights' is not one of")


def test_wrong_type_names_key_and_type():
    rejects(["actor_rollout_ref.actor.optim.lr=abc"], "actor_rollout_ref.actor.optim.lr", "float")
    rejects(["actor_rollout_ref.rollout.n=two"], "actor_rollout_ref.rollout.n", "int")
    rejects(["actor_rollout_ref.actor.use_kl_loss=maybe"], "use_kl_loss", "bool")
    rejects(["actor_rollout_ref.actor=3"], "is a section")


@pytest.mark.parametrize("overrides,fragment", [
    (["algorithm.adv_estimator=gpg", "actor_rollout_ref.rollout.n=1"], "rollout.n >= 2"),  # grpo / rloo: a note
    (["algorithm.adv_estimator=grpo_passk"], "rollout.n >= 2"),
    (["data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], "divisible"),
    (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "clip_ratio_c must be > 1"),
    (["actor_rollout_ref.actor.loss_agg_mode=token-max"], "loss_agg_mode"),
    (["algorithm.adv_estimator=gae", "critic.enable=False"], "needs a critic"),
    (["algorithm.adv_estimator=grpoo", "actor_rollout_ref.rollout.n=4"], "Did you mean 'grpo'"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=vanila"], "Did you mean 'vanilla'"),
    (["actor_rollout_ref.actor.kl_loss_type=k4"], "not a KL estimator"),
    (["data.truncation=sideways"], "data.truncation"),
    (["trainer.logger=['console','slack']"], "trainer.logger"),
    (["trainer.resume_mode=resume_path"], "resume_from_path"),
    (["algorithm.kl_ctrl.type=pid"], "kl_ctrl.type"),
    (["algorithm.adv_estimator=gdpo", "actor_rollout_ref.rollout.n=4"], "gdpo_reward_keys"),
    (["algorithm.adv_estimator=gdpo", "actor_rollout_ref.rollout.n=4", "algorithm.gdpo_reward_keys=[a,b]",
      "algorithm.gdpo_reward_weights=[1.0]"], "one weight per entry"),
    (["algorithm.rollout_correction.rollout_is=geometric"], "rollout_is='geometric'"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0"],
     "rollout_is_threshold"),
    (["algorithm.rollout_correction.rollout_rs=token_k1"], "rollout_rs_threshold=None must be a number"),
    (["algorithm.rollout_correction.rollout_rs=token_k4", "algorithm.rollout_correction.rollout_rs_threshold=2"],
     "each option must be one of"),
    (["algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k2'",
      "algorithm.rollout_correction.rollout_rs_threshold='0.6_1.6,2.5,3'"], "one per option (2)"),
    (["algorithm.rollout_correction.rollout_rs=seq_max_k2", "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
     "one upper bound, not a range"),
    (["algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=1.6_0.6"],
     "needs 0 < lower <= upper"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_mode=clip"],
     "rollout_is_mode='clip'"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_mode=mask",
      "algorithm.rollout_correction.rollout_is_threshold=0.5"], "needs rollout_is_threshold >= 1"),
    (["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0"], "clip_cov_ratio"),
    (["actor_rollout_ref.actor.policy_loss.clip_cov_lb=6"], "clip_cov_lb"),
    (["actor_rollout_ref.actor.tau_neg=0"], "tau_pos and tau_neg"),
    (["actor_rollout_ref.rollout.response_length=1024", "data.max_response_length=512"],
     "rollout.response_length=1024 differs from data.max_response_length=512"),
])
def test_inconsistent_settings_are_rejected(overrides, fragment):
    rejects(OK + overrides, fragment)


def test_one_response_length_bounds_generation_and_the_penalties():
    """rollout.response_length may only repeat data.max_response_length: generation, DAPO's overlong window and
    Dr. GRPO's constant then all read the same length."""
    cfg = load_config(None, OK + ["actor_rollout_ref.rollout.response_length=700", "data.max_response_length=700"])
    assert cfg.actor_rollout_ref.rollout.response_length == cfg.data.max_response_length == 700
    assert load_config(None, OK + ["data.max_response_length=700"]).actor_rollout_ref.rollout.response_length is None


def test_kl_plus_variant_accepted():
    cfg = load_config(None, OK + ["actor_rollout_ref.actor.kl_loss_type=k3+", "algorithm.kl_penalty=k1+"])
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "k3+"


MT = "actor_rollout_ref.rollout.multi_turn"
MT_ON = f"{MT}.enable=True"


def test_multi_turn_defaults_are_the_familiar_ones():
    """The multi-turn and agent keys keep the familiar tree's names and defaults, so its command lines mean the
    same; tool_timeout_s is posttrain's own."""
    from posttrain.config.loader import default_of

    familiar = {"enable": False, "max_assistant_turns": None, "tool_config_path": None, "function_tool_path": None,
                "max_user_turns": None, "max_parallel_calls": 1, "max_tool_response_length": 256,
                "tool_response_truncate_side": "middle", "use_inference_chat_template": False,
                "tokenization_sanity_check_mode": "strict", "format": "hermes"}
    assert {k: default_of(f"{MT}.{k}") for k in familiar} == familiar
    assert default_of(f"{MT}.tool_timeout_s") == 30
    assert default_of("actor_rollout_ref.rollout.agent.default_agent_loop") == "single_turn_agent"
    assert default_of("actor_rollout_ref.rollout.agent.num_workers") == 8
    assert default_of("actor_rollout_ref.rollout.mode") == "async"


def test_multi_turn_settings_act(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n")
    functions = tmp_path / "functions.py"
    functions.write_text("from posttrain.tools import function_tool\n\n\n@function_tool\n"
                         "def add(a: int, b: int) -> int:\n    \"\"\"Add.\n\n    Args:\n        a: one\n"
                         "        b: two\n    \"\"\"\n    return a + b\n")  # (tool files are imported at load)
    cfg = load_config(None, OK + [MT_ON, f"{MT}.max_assistant_turns=5", f"{MT}.tool_config_path={tools}",
                                  f"{MT}.function_tool_path={functions}", f"{MT}.tool_response_truncate_side=left",
                                  "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                                  "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.mode=sync"])
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_assistant_turns == 5 and mt.tool_config_path == str(tools)
    assert mt.function_tool_path == str(functions) and mt.tool_response_truncate_side == "left"
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"


def test_tools_no_episode_offers_are_noted(tmp_path):
    from posttrain.config import config_warnings

    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n")
    off = "\n".join(config_warnings(load_config(None, OK + [f"{MT}.tool_config_path={tools}"])))
    assert "enable=False: rollouts are single-turn and offer no tools" in off
    single = "\n".join(config_warnings(load_config(None, OK + [MT_ON, f"{MT}.tool_config_path={tools}"])))
    assert "only rows whose agent_name column names tool_agent call the tools" in single
    assert not config_warnings(load_config(None, OK + [MT_ON, f"{MT}.tool_config_path={tools}",
                                                       "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]))


def test_multi_turn_settings_it_cannot_run_are_rejected(tmp_path):
    bad_python = tmp_path / "bad.py"
    bad_python.write_text("def add(a, b):\n  return a +\n")
    no_tools = tmp_path / "trainer.yaml"
    no_tools.write_text("data:\n  train_batch_size: 8\n")
    vision = tmp_path / "vl_model"
    vision.mkdir()
    (vision / "config.json").write_text('{"model_type": "qwen2_5_vl", "vision_config": {"depth": 2}}')
    cases = [
        ([MT_ON, "actor_rollout_ref.rollout.name=hf"], "rollout.name=hf (transformers' generate) cannot"),
        ([MT_ON, f"{MT}.format=llama3_json"], "format='llama3_json': posttrain parses tool calls in the hermes"),
        ([f"{MT}.use_inference_chat_template=True"], "use_inference_chat_template=True: posttrain's episodes go on"),
        ([f"{MT}.tool_config_path=/no/such/tools.yaml"], "tool_config_path: '/no/such/tools.yaml' does not exist"),
        ([f"{MT}.function_tool_path={bad_python}"], "is not valid Python (line 2"),
        ([f"{MT}.tool_config_path={no_tools}"], "must hold a list `tools:` whose entries each have a class_name"),
        ([f"{MT}.tool_response_truncate_side=top"], "tool_response_truncate_side='top' is not one of"),
        ([f"{MT}.tokenization_sanity_check_mode=loose"], "tokenization_sanity_check_mode='loose' is not one of"),
        ([f"{MT}.max_assistant_turns=0"], "max_assistant_turns=0 must be >= 1 (or null: no limit)"),
        ([f"{MT}.max_user_turns=-1"], "max_user_turns=-1 must be >= 1 (or null: no limit)"),
        ([f"{MT}.max_parallel_calls=0"], "max_parallel_calls=0 must be >= 1"),
        ([f"{MT}.max_tool_response_length=0"], "max_tool_response_length=0 must be >= 1"),
        ([f"{MT}.tool_timeout_s=0"], "tool_timeout_s=0.0 must be positive"),
        (["actor_rollout_ref.rollout.agent.num_workers=0"], "agent.num_workers=0 must be >= 1"),
        (["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"],
         "default_agent_loop=tool_agent runs multi-turn episodes, which need"),
        ([MT_ON, "actor_rollout_ref.rollout.agent.default_agent_loop="], "default_agent_loop must name an environment"),
        (["actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml"],
         "agent_loop_config_path: 'loops.yaml' does not exist"),
        ([f"{MT}.interaction_config_path=interaction.yaml"], "custom agent loop and interaction classes are not loaded"),
        (["actor_rollout_ref.rollout.agent.custom_async_server.path=server.py"], "no separate server or manager"),
        (["actor_rollout_ref.rollout.mode=batch"], "rollout.mode='batch' is not one of"),
        ([f"actor_rollout_ref.model.path={vision}", "actor_rollout_ref.rollout.agent.program='python play.py'"],
         "agent.program with the vision-language model"),
    ]
    for overrides, fragment in cases:
        rejects(OK + overrides, fragment)
    # the same model single-turn and in episodes (which carry its images), and the defaults, load
    load_config(None, OK + [f"actor_rollout_ref.model.path={vision}"])
    load_config(None, OK + [MT_ON, f"actor_rollout_ref.model.path={vision}"])
    load_config(None, OK + [MT_ON])


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, OK + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=5",
                                  "actor_rollout_ref.model.override_config.attention_dropout=0.0"])
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(str(path))
    assert again == cfg
    assert again.actor_rollout_ref.model.override_config == {"attention_dropout": 0.0}
    # overrides apply on top of the file
    assert load_config(str(path), ["actor_rollout_ref.rollout.n=3"]).actor_rollout_ref.rollout.n == 3


def test_yaml_file_with_unknown_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"total_epoch": 3}}))
    with pytest.raises(ConfigError, match="Did you mean 'trainer.total_epochs'"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_every_key_is_documented():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    import re

    missing = [k for k in all_keys() if not re.search(rf"[`./ ]{re.escape(k.rpartition('.')[2])}[` /]", doc)]
    assert not missing, f"keys missing from docs/config.md: {missing}"



@dataclasses.dataclass
class _Offload:
    param_offload: bool = False
    """keep weights in CPU memory,
    between steps"""
    size: int = -1
    """ranks per group"""


@dataclasses.dataclass
class _Roles:
    actor: _Offload = dataclasses.field(default_factory=_Offload)
    ref: _Offload = dataclasses.field(default_factory=_Offload)
    """param_offload: keep the reference's weights in CPU memory: it has
    no optimizer
    size: as the actor's"""
    critic: _Offload = dataclasses.field(default_factory=_Offload)
    """*: as the actor's"""


@dataclasses.dataclass
class _Undocumented:
    roles: _Roles = dataclasses.field(default_factory=_Roles)
    seed: int = 1


@dataclasses.dataclass
class _MisspeltEntry:
    ref: _Offload = dataclasses.field(default_factory=_Offload)
    """param_ofload: kept in CPU memory"""


def test_key_descriptions_are_the_strings_under_the_fields():
    """A key's description is the string under its field, folded to one line; under a section field used in a second
    place, `key: text` entries say what its keys mean there (continued on lines that start with no key), `*` all."""
    from posttrain.config.fielddocs import descriptions

    assert descriptions(_Roles) == {
        "actor.param_offload": "keep weights in CPU memory, between steps", "actor.size": "ranks per group",
        "ref.param_offload": "keep the reference's weights in CPU memory: it has no optimizer",
        "ref.size": "as the actor's", "critic.param_offload": "as the actor's", "critic.size": "as the actor's"}
    with pytest.raises(ValueError, match="config key seed has no description"):
        descriptions(_Undocumented)
    with pytest.raises(ValueError, match="ref: .*'param_ofload: kept in CPU memory'"):
        descriptions(_MisspeltEntry)


def test_checking_a_config_reads_it_and_returns_its_problems():
    """Validation returns the problems it finds and leaves the config as it was; what has several spellings (a
    logger name for a list of them, a Megatron LoRA layout's tensor parallel) is settled before, by normalise, which
    the loader runs first."""
    import copy

    from posttrain.config.normalise import normalise
    from posttrain.config.schema import Config
    from posttrain.config.validate import config_problems

    cfg = Config()
    cfg.trainer.logger, cfg.trainer.n_gpus_per_node = "console", 2
    cfg.actor_rollout_ref.actor.strategy, cfg.actor_rollout_ref.model.lora_rank = "megatron", 8
    cfg.actor_rollout_ref.actor.fsdp_config.tp_size, cfg.actor_rollout_ref.actor.clip_ratio_c = 2, 1.0
    before = copy.deepcopy(cfg)
    problems = config_problems(cfg)
    assert cfg == before
    assert len(problems) == 2 and "lora_rank=8 with tp_size=2" in str(problems.items) and "clip_ratio_c" in str(
        problems.items)
    assert len(config_problems(Config())) == 0  # each check collects its own problems
    normalise(cfg)
    assert cfg.trainer.logger == ["console"] and cfg.actor_rollout_ref.actor.fsdp_config.tp_size == 1
    assert [m for ms in config_problems(cfg).items.values() for m in ms] == [
        "actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual-clip bound), got 1.0"]
    loaded = load_config(None, OK + ["trainer.logger=console", "trainer.n_gpus_per_node=2",
                                     "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.model.lora_rank=8",
                                     "actor_rollout_ref.actor.fsdp_config.tp_size=2"])
    assert loaded.trainer.logger == ["console"] and loaded.actor_rollout_ref.actor.fsdp_config.tp_size == 1

def test_cli_print_config_and_typo():
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "--print-config"]
    out = subprocess.run(cmd + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=5"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    tree = yaml.safe_load(out.stdout)
    assert tree["algorithm"]["adv_estimator"] == "grpo" and tree["actor_rollout_ref"]["rollout"]["n"] == 5
    bad = subprocess.run(cmd + ["actor_rollout_ref.actor.use_kl_los=True"], capture_output=True, text=True)
    assert bad.returncode == 2 and "use_kl_loss" in bad.stderr


def test_distillation_keys_are_checked_when_the_config_loads():
    """One teacher needs a model_path; k1 backpropagated directly, a second policy loss, unknown teacher keys, a
    `teacher_model` entry beside other teachers and teachers without or with the same routing key are refused."""
    on, t = "distillation.enabled=True", "distillation.teacher_models"
    cfg = load_config(None, [on, f"{t}.teacher_model.model_path=/m", "distillation.distillation_loss.topk=8"])
    assert cfg.distillation.teacher_models == {"teacher_model": {"model_path": "/m"}}
    # the key tree's empty `teacher_model` default beside named teachers (a dumped config) is left out
    from posttrain.config.distillation import teachers

    cfg = load_config(None, [on, f"{t}.teacher_model.model_path=null", f"{t}.t1.model_path=/m", f"{t}.t1.key=a",
                             f"{t}.t2.model_path=/n", f"{t}.t2.key=b", f"{t}.t2.inference.dtype=bfloat16"])
    assert [(x.name, x.key, x.model_path) for x in teachers(cfg)] == [("t1", "a", "/m"), ("t2", "b", "/n")]
    refused = {
        (on,): "needs a teacher",
        (on, f"{t}.teacher_model.key=x"): "model_path is required",
        (on, f"{t}.teacher_model.model_path=/m", "distillation.distillation_loss.loss_mode=k1"):
            "needs use_policy_gradient=True",
        (on, f"{t}.teacher_model.model_path=/m", "distillation.distillation_loss.policy_loss_mode=gspo"):
            "only `vanilla`",
        (on, f"{t}.teacher_model.model_path=/m", f"{t}.teacher_model.modle_path=/m"): "unknown keys",
        (on, f"{t}.teacher_model.model_path=/m", f"+{t}.t2.model_path=/n", f"{t}.t2.key=b"): "rename it",
        (on, f"{t}.t1.model_path=/m", f"{t}.t2.model_path=/n", f"{t}.t2.key=b"): "must name the value",
        (on, f"{t}.t1.model_path=/m", f"{t}.t1.key=b", f"{t}.t2.model_path=/n", f"{t}.t2.key=b"): "the same key",
    }
    for overrides, fragment in refused.items():
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, list(overrides))
