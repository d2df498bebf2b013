"""Familiar command lines: every key has a decision, problems come all at once, Hydra flags, load-time checks, and
the recorded example scripts (tests/data/familiar_scripts) load or fail with one message naming every problem."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config import ConfigError, all_keys, config_warnings, hydra_config, load_config
from posttrain.config import docpage, keytable
from posttrain.config.fielddocs import descriptions
from posttrain.config.loader import default_of

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "data" / "familiar_scripts"
OK = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
POSTTRAIN_ENGINE = "actor_rollout_ref.rollout.name=posttrain"

# Scripts that do not load, each with a fragment of the reason its one message gives.
NOT_LOADING = {
    "grpo_trainer/run_minicpmo2_6.sh": "data.custom_cls.path",
    "grpo_trainer/run_qwen2-32b_sglang_fsdp_npu.sh": "custom_reward_function.path",
    "grpo_trainer/run_qwen3_vl-30b-megatron.sh": "tp_size=2 must divide the 1 processes",
    "ppo_trainer/run_deepseek7b_llm_pfppo.sh": "PF-PPO",
}

# The newest tree (tests/data/familiar_scripts_2026_08): scripts that do not load, each with a fragment of its reason.
NEWEST = ROOT / "tests" / "data" / "familiar_scripts_2026_08"
NPU = "trainer.device='npu'"
REPLAY = "router_replay.mode=R3 with actor_rollout_ref.rollout.name=vllm"
NOT_LOADING_2026 = {
    "ascend_extras/grpo_trainer/run_qwen3_235b_256k_megatron.sh": [NPU],
    "ascend_extras/grpo_trainer/run_qwen3_30b_a3b_megatron.sh": [NPU],
    "ascend_extras/grpo_trainer/run_qwen3_next_80b_fsdp.sh": [NPU],
    "ascend_extras/gspo_trainer/run_qwen3_32b_fsdp.sh": [NPU],
    "grpo_trainer/run_deepseek_v4_flash_megatron.sh": [REPLAY],
    "grpo_trainer/run_deepseek_v4_veomni.sh": [REPLAY],
    "grpo_trainer/run_minicpm_o_2_6_fsdp.sh": ["data.custom_cls.path"],
    "grpo_trainer/run_qwen3_5_2b_openr1_fsdp.sh": ["reward_score/openr1mm.py"],
    "grpo_trainer/run_qwen3_5_2b_video_fsdp.sh": ["reward_score/tinyllava_video_r1.py"],
    "mtp_trainer/run_mimo_7b_mtp_megatron.sh": ["multi-token prediction"],
    "mtp_trainer/run_mimo_7b_mtp_rl_vllm_sgl_megatron.sh": ["multi-token prediction"],
    "router_replay/run_qwen3_30b_a3b_megatron.sh": [REPLAY],
}


def rejects(overrides, *fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


@pytest.fixture
def tracking_installed(monkeypatch):
    """As with `pip install 'posttrain[tracking]'`: the scripts log to wandb."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("wandb", "mlflow") else real(name, *a))


@pytest.fixture
def vllm_installed(monkeypatch):
    """As where vLLM is installed: the scripts that name it load with their vLLM settings (without it,
    `rollout.name=vllm` is refused at load; the check looks for the module, it does not import it)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))


def test_every_familiar_key_has_a_decision():
    keys = (ROOT / "docs" / "familiar_keys.txt").read_text().split()
    ours = set(all_keys())
    mappings = [k for k in ours if isinstance(default_of(k), dict)]
    undecided = [k for k in keys if k not in ours and keytable.find_rule(k) is None
                 and not any(k.startswith(m + ".") for m in mappings)]
    assert len(keys) > 700 and not undecided, undecided
    assert set(descriptions()) == ours  # each of posttrain's own keys says what it does
    # and every rule decides some familiar key (the two exceptions are mappings users fill in themselves)
    unused = [r.pattern for r in keytable.RULES
              if not any(keytable._match(r.pattern.split("."), k.split(".")) is not None for k in keys)]
    assert set(unused) <= {"critic.model.override_config.model_config.*", "actor_rollout_ref.rollout.engine_kwargs"}, unused


def test_config_docs_are_generated_from_the_table():
    doc = (ROOT / "docs" / "config.md").read_text()
    intro = doc.split(docpage.INTRO_END)[0] + docpage.INTRO_END
    keys = (ROOT / "docs" / "familiar_keys.txt").read_text().split()
    assert doc == docpage.render(keys, intro), "docs/config.md is stale: run python -m posttrain.config.docpage"


def test_all_problems_in_one_message_grouped():
    message = rejects(OK + ["actor_rollout_ref.actor.use_kl_los=True", "trainer.total_epoch=3",
                            "actor_rollout_ref.rollout.n=two", "algorithm.use_pf_ppo=True",
                            "actor_rollout_ref.rollout.multi_turn.format=llama3_json",
                            "actor_rollout_ref.actor.clip_ratio_c=1",
                            "data.train_files=/no/such.parquet", "actor_rollout_ref.model.path=/nope"])
    assert message.startswith("8 problems")
    for group in ("unknown keys:", "not supported by posttrain:", "wrong values:",
                  "settings that do not fit together:", "files, models and packages:"):
        assert group in message
    for fragment in ("use_kl_loss", "trainer.total_epochs", "rollout.n", "PF-PPO", "tool calls in the hermes format",
                     "clip_ratio_c", "/no/such.parquet", "'/nope'"):
        assert fragment in message


def test_suggestions_only_when_close():
    assert "Did you mean 'actor_rollout_ref.actor.entropy_coeff'" in rejects(["actor_rollout_ref.actor.entropy_coef=0"])
    far = rejects(["actor_rollout_ref.actor.sparkle_mode=1"])
    assert "Did you mean" not in far and "'actor_rollout_ref.actor' has:" in far and "entropy_coeff" in far
    deep = rejects(["trainer.nonsense.deep=1"])
    assert "'trainer' has:" in deep and "total_epochs" in deep


def test_foreign_keys_map_note_or_reject():
    cfg = load_config(None, OK + ["trainer.n_gpus_per_node=4",
                                  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                  "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                                  "actor_rollout_ref.actor.optim.clip_grad=0.5",
                                  "+reward_model.reward_kwargs.overlong_buffer_cfg.len=8",
                                  "actor_rollout_ref.actor.use_torch_compile=True",
                                  "+actor_rollout_ref.model.override_config.model_config.attention_dropout=0.1",
                                  "actor_rollout_ref.actor.strategy=megatron"])
    actor = cfg.actor_rollout_ref.actor
    assert actor.fsdp_config.tp_size == 2 and actor.grad_clip == 0.5
    assert cfg.reward_model.overlong_buffer.len == 8
    assert cfg.actor_rollout_ref.model.override_config == {"attention_dropout": 0.1}
    notes = "\n".join(config_warnings(cfg))
    assert "the 4 processes run tensor parallel 2" in notes and "x 2 ranks holding the same rows" in notes
    assert "x 1 data-parallel ranks, Megatron's data-parallel size" in notes and "use_torch_compile" in notes
    assert cfg.actor_rollout_ref.actor.row_replicas == 2
    assert "pipeline_model_parallel_size" in notes and "optim.clip_grad -> actor_rollout_ref.actor.grad_clip" in notes
    # harmless values of unsupported features pass; others are rejected with the reason
    load_config(None, OK + ["actor_rollout_ref.rollout.multi_turn.enable=False", "algorithm.use_pf_ppo=False"])
    rejects(OK + ["actor_rollout_ref.model.lora.dropout=0.1"], "is not supported", "no dropout")


def test_newest_tree_keys_act():
    """The newest tree's engine families, engine sections, reward block and file logger set posttrain's own keys
    (and say so); a value with no counterpart is rejected with the reason."""
    cfg = load_config(None, OK + ["model_engine=megatron", "actor_rollout_ref.actor.veomni.param_offload=True",
                                  "actor_rollout_ref.actor.veomni.optimizer_offload=True",
                                  "actor_rollout_ref.ref.veomni.enable_full_shard=False",
                                  "actor_rollout_ref.actor.veomni.fsdp_size=1",
                                  "critic.fsdp.param_offload=True", "actor_rollout_ref.actor.policy_loss.tau_neg=2.5",
                                  "reward.custom_reward_function.name=my_score",
                                  "reward.reward_manager.name=dapo", "reward.reward_kwargs.overlong_buffer_cfg.len=64",
                                  "reward.reward_model.enable=False", "reward.num_workers=3",
                                  "trainer.logger=['console','file']"])
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == "megatron" and cfg.critic.strategy == "megatron"
    assert arr.actor.fsdp_config.param_offload and arr.actor.fsdp_config.optimizer_offload
    assert arr.ref.fsdp_config.reshard_after_forward is False and arr.actor.fsdp_config.fsdp_size == 1
    assert cfg.critic.model.fsdp_config.param_offload and arr.actor.tau_neg == 2.5
    assert cfg.custom_reward_function.name == "my_score" and cfg.reward_model.reward_manager == "dapo"
    assert cfg.reward_model.overlong_buffer.len == 64 and cfg.reward_model.num_workers == 3
    assert cfg.trainer.logger == ["console", "jsonl"]
    notes = "\n".join(config_warnings(cfg))
    assert "model_engine=megatron -> actor_rollout_ref.actor.strategy=megatron" in notes
    assert "trainer.logger entry file -> jsonl" in notes
    turbo = load_config(None, OK + ["actor_rollout_ref.actor.strategy=fsdp_turbo",
                                    "+actor_rollout_ref.actor.fsdp_config.turbo_config.memory.recompute=False",
                                    "actor_rollout_ref.actor.fsdp_config.turbo_config.distributed."
                                    "ulysses_parallel_size=2"])
    assert turbo.actor_rollout_ref.actor.strategy == "fsdp2"
    assert turbo.actor_rollout_ref.model.enable_gradient_checkpointing is False
    assert "ulysses_parallel_size" in "\n".join(config_warnings(turbo))
    mlite = load_config(None, OK + ["actor@actor_rollout_ref.actor=mlite_actor", "actor_rollout_ref.actor.engine.tp=2",
                                    "trainer.n_gpus_per_node=4"])
    assert mlite.actor_rollout_ref.actor.strategy == "megatron" and mlite.actor_rollout_ref.actor.fsdp_config.tp_size == 2
    rejects(OK + ["model_engine=torchtitan", "distillation.enabled=True"], "model_engine='torchtitan' is not "
            "supported", "distillation.enabled=True needs a teacher")
    rejects(OK + ["algorithm.rollout_correction.rollout_is=token",
                  "algorithm.rollout_correction.rollout_is_threshold=1.5_4.0", "algorithm.adv_estimator=opo",
                  "actor_rollout_ref.rollout.n=1"], "rollout_is_threshold='1.5_4.0': a range lower_upper needs 0 < "
            "lower <= 1 <= upper", "rollout.n >= 2 (got 1)")
    rejects(OK + ["algorithm.rollout_correction.rollout_is_threshold=high"], "neither a number nor a range")
    assert load_config(None, OK + ["algorithm.rollout_correction.rollout_is_threshold=3"]).algorithm.rollout_correction \
        .rollout_is_threshold == 3.0


def test_grpo_with_one_response_per_prompt_takes_the_raw_score_as_the_advantage():
    """GRPO with rollout.n=1 loads with a note: a group of one has mean 0 and standard deviation 1, as in verl, so
    each advantage is the response's score / (1 + 1e-6) on its response tokens (score alone without the std
    division); other group estimators still need n >= 2."""
    from posttrain.algo import compute_advantage

    cfg = load_config(None, OK + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"])
    assert any("REINFORCE without a baseline" in note for note in config_warnings(cfg))
    assert not any("REINFORCE" in note for note in config_warnings(load_config(None, OK)))
    rejects(OK + ["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"], "rollout.n >= 2 (got 1)")
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    mask = torch.ones(5, 6, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    for norm in (True, False):
        adv, _ = compute_advantage("grpo", token_level_rewards=rewards * mask, response_mask=mask,
                                   index=[f"p{i}" for i in range(5)], norm_adv_by_std_in_grpo=norm)
        for i in range(5):
            score = sum(float(rewards[i, t]) for t in range(6) if mask[i, t])
            want = (score - 0.0) / (1.0 + 1e-6) if norm else score - 0.0
            for t in range(6):
                assert float(adv[i, t]) == pytest.approx(want * float(mask[i, t]), rel=1e-12, abs=1e-12)


def test_bypass_mode_with_rollout_is_trains_on_the_rollout_log_probs_without_weights():
    """`bypass_mode=True` with `rollout_is` loads with a note: the rollout's log-probs become the old policy's and no
    importance weights are applied, as in verl's bypass mode with loss_type=ppo_clip. The weights it would apply,
    pi_old / pi_rollout with pi_old = pi_rollout, are exactly 1 (float64), so leaving them out changes nothing."""
    from types import SimpleNamespace

    from posttrain.algo.rollout_correction import rollout_is_weights
    from posttrain.data.batch import Batch
    from posttrain.trainer.rl import RLTrainer

    keys = ["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.rollout_is=sequence",
            "algorithm.rollout_correction.rollout_is_threshold=2.0", "actor_rollout_ref.rollout.calculate_log_probs=True"]
    cfg = load_config(None, OK + keys)
    assert any("no importance weights are applied" in note for note in config_warnings(cfg))
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 3
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[2, 3:] = 0
    batch = Batch({"rollout_log_probs": rollout, "response_mask": mask}, {})
    assert RLTrainer._rollout_correction(SimpleNamespace(cfg=cfg), batch) == {}
    assert torch.equal(batch["old_log_probs"], rollout) and "rollout_is_weights" not in batch
    for level in ("token", "sequence"):
        for normalize in (False, True):  # (normalising divides by the mean plus a small epsilon)
            w, _ = rollout_is_weights(rollout, rollout, mask.double(), level=level, threshold=2.0,
                                      batch_normalize=normalize)
            for i in range(4):
                for t in range(5):
                    assert float(w[i, t]) == pytest.approx(float(mask[i, t]), rel=1e-8, abs=0)


def test_a_rollout_is_threshold_range_masks_weights_outside_it():
    """`rollout_is_threshold=lower_upper` (verl's IcePop) loads and keeps rho = pi_old / pi_rollout where lower <= rho
    <= upper and 0 elsewhere (per token, or per response with `sequence`), whatever rollout_is_mode says; checked in
    float64 against a plain loop."""
    from posttrain.algo.rollout_correction import rollout_is_weights

    cfg = load_config(None, OK + ["algorithm.rollout_correction.rollout_is=token",
                                  "algorithm.rollout_correction.rollout_is_threshold=0.5_4.0"])
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_4.0"
    gen = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.float64)
    mask[1, 2:] = 0
    mask[4, 4:] = 0
    for level in ("token", "sequence"):
        w, _ = rollout_is_weights(old, rollout, mask, level=level, threshold="0.5_4.0", mode="truncate")
        for i in range(6):
            seq = math.exp(sum(float(old[i, t] - rollout[i, t]) for t in range(5) if mask[i, t]))
            for t in range(5):
                rho = math.exp(float(old[i, t] - rollout[i, t])) if level == "token" else seq
                want = rho if mask[i, t] and 0.5 <= rho <= 4.0 else 0.0
                assert float(w[i, t]) == pytest.approx(want, rel=1e-12, abs=1e-12), (level, i, t)
        assert (w == 0).any() and (w > 0).any()


def test_lora_exclude_modules_leaves_modules_without_adapters(tiny_model_dir):
    """`model.exclude_modules` (and Megatron's `lora.exclude_modules`) keeps LoRA off the modules it names: a regular
    expression matching the whole name, or a list of name endings."""
    from posttrain.models.load import LoraSettings, load_causal_lm

    cfg = load_config(None, OK + ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.exclude_modules=.*mlp.*"])
    assert cfg.actor_rollout_ref.model.exclude_modules == ".*mlp.*"
    mapped = load_config(None, OK + ["actor_rollout_ref.model.lora_rank=4",
                                     "actor_rollout_ref.model.lora.exclude_modules=[o_proj]"])
    assert mapped.actor_rollout_ref.model.exclude_modules == ["o_proj"]

    def adapted(exclude):
        model = LoraSettings(4, 8, "all-linear", exclude).apply(load_causal_lm(str(tiny_model_dir)))
        return {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if ".lora_A" in n}

    everything = adapted(None)
    assert {"q_proj", "o_proj", "gate_proj", "down_proj"} <= everything
    assert adapted(".*mlp.*") == everything - {"gate_proj", "up_proj", "down_proj"}
    assert adapted(["o_proj"]) == everything - {"o_proj"}
    rejects(OK + ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.exclude_modules=3"],
            "exclude_modules must be a regular expression or a list")


def test_lora_adapter_path_continues_from_the_saved_adapter(tiny_model_dir, saved_adapter):
    """`model.lora_adapter_path` starts LoRA from a saved adapter: its rank and modules (whatever lora_rank says) and
    its weights, trainable; the meta-device build of the other ranks has the same adapter parameters. A folder without
    adapter_config.json is refused at load."""
    from safetensors.torch import load_file

    from posttrain.models.load import LoraSettings, load_causal_lm

    cfg = load_config(None, OK + [f"actor_rollout_ref.model.lora.adapter_path={saved_adapter}"])
    assert cfg.actor_rollout_ref.model.lora_adapter_path == saved_adapter
    settings = LoraSettings(0, adapter_path=saved_adapter)
    model = settings.apply(load_causal_lm(str(tiny_model_dir)))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    saved = load_file(str(Path(saved_adapter) / "adapter_model.safetensors"))
    assert len(lora) == len(saved) and all(p.requires_grad for p in lora.values())
    for name, tensor in saved.items():  # peft saves `...q_proj.lora_A.weight` for `...q_proj.lora_A.default.weight`
        live = lora[name.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight",
                                                                                     ".lora_B.default.weight")]
        assert torch.equal(live.detach(), tensor) and live.shape[-1 if "lora_B" in name else 0] == 4
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora} == {"q_proj", "v_proj"}
    meta = settings.apply(load_causal_lm(str(tiny_model_dir), meta=True))
    assert {n: p.shape for n, p in meta.named_parameters() if "lora_" in n} == {n: p.shape for n, p in lora.items()}
    rejects(OK + [f"actor_rollout_ref.model.lora_adapter_path={tiny_model_dir}"], "adapter_config.json")


# The familiar GSM8K multi-turn example: its config file (a Hydra defaults list on the stock tree), its tool file and
# its command line, with only the paths changed (verl, Apache License 2.0: examples/sglang_multiturn/
# run_qwen2.5-3b_gsm8k_multiturn.sh, config/gsm8k_multiturn_grpo.yaml, config/tool_config/gsm8k_tool_config.yaml).
GSM8K_MULTITURN_YAML = """hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""
GSM8K_TOOL_YAML = """tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k."
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
GSM8K_MULTITURN_ARGS = """algorithm.adv_estimator=grpo data.train_batch_size=256 data.max_prompt_length=1024
data.max_response_length=1024 data.filter_overlong_prompts=True data.truncation='error' data.return_raw_chat=True
actor_rollout_ref.model.path=MODEL actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False global_profiler.tool=torch_memory
global_profiler.save_path=./mem_snapshots global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries=100000
global_profiler.global_tool_config.torch_memory.stack_depth=32 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.name=sglang
actor_rollout_ref.rollout.gpu_memory_utilization=0.85 actor_rollout_ref.rollout.multi_stage_wake_up=True
actor_rollout_ref.rollout.n=16 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32
actor_rollout_ref.ref.fsdp_config.param_offload=True actor_rollout_ref.rollout.over_sample_rate=0.1
actor_rollout_ref.rollout.mode=async algorithm.use_kl_in_reward=False trainer.critic_warmup=0
trainer.logger=["console","wandb"] trainer.project_name='multi-turn-grpo-qwen2.5-3b-sglang' trainer.experiment_name=x
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=20 trainer.val_before_train=True
data.train_files=DATA data.val_files=DATA actor_rollout_ref.rollout.multi_turn.tool_config_path=TOOLS
trainer.total_epochs=15"""


def test_familiar_multi_turn_example_loads(tmp_path, tiny_model_dir, gsm8k_file, tracking_installed):
    """The GSM8K multi-turn example's config file, Hydra defaults list included, and command line load with only the
    paths changed; its multi-turn keys act, and what has no effect here is said."""
    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(GSM8K_MULTITURN_YAML)
    (tmp_path / "gsm8k_tool_config.yaml").write_text(GSM8K_TOOL_YAML)
    args = (GSM8K_MULTITURN_ARGS.replace("MODEL", str(tiny_model_dir)).replace("DATA", gsm8k_file)
            .replace("TOOLS", str(tmp_path / "gsm8k_tool_config.yaml")).split())
    config_file, base = hydra_config(str(tmp_path), "gsm8k_multiturn_grpo")
    cfg = load_config(config_file, base + args)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.multi_turn.enable and rollout.multi_turn.max_assistant_turns == 5
    assert rollout.multi_turn.tool_config_path == str(tmp_path / "gsm8k_tool_config.yaml")
    assert cfg.data.return_raw_chat and rollout.mode == "async" and rollout.n == 16
    notes = "\n".join(config_warnings(cfg))
    assert "hydra (Hydra's own settings" in notes and "over_sample_rate" in notes
    assert "only rows whose agent_name column names tool_agent call the tools" in notes
    # a defaults list naming another tree is not read
    (tmp_path / "other.yaml").write_text("defaults:\n  - ppo_trainer\n  - override rollout: sglang\n")
    with pytest.raises(ConfigError, match="has a Hydra 'defaults' list with .*override rollout"):
        load_config(str(tmp_path / "other.yaml"))
    (tmp_path / "megatron.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\n"
                                            "actor_rollout_ref:\n  actor:\n    strategy: fsdp\n")
    assert load_config(str(tmp_path / "megatron.yaml"), OK).critic.strategy == "megatron"
    assert load_config(str(tmp_path / "megatron.yaml"), OK).actor_rollout_ref.actor.strategy == "fsdp"


# The configuration of the familiar multi-turn docs (verl, Apache License 2.0: docs/sglang_multiturn/multiturn.rst):
# function tools with the tool agent, its tokenization check example, and the tool file it shows.
DOCS_MULTITURN_YAML = """actor_rollout_ref:
    rollout:
        mode: async
        multi_turn:
            enable: True
            format: hermes  # or any other format your model's chat template supports
            function_tool_path: TOOL_FILE
            tokenization_sanity_check_mode: "ignore_strippable"  # Choose from: "disable", "ignore_strippable", "strict"
        agent:
            default_agent_loop: tool_agent
"""
DOCS_TOOL_FILE = '''from verl.tools.function_tool import function_tool

@function_tool
def get_weather(city: str) -> dict:
    """Get the current weather for a city.

    Args:
        city: The city to look up, e.g. "Tokyo" or "San Francisco".
    """
    return {"temperature_c": 17.3, "condition": "drizzle"}

@function_tool("calculator")  # explicit name overrides the function name
def calculator(expression: str) -> str:
    """Evaluate a Python-style arithmetic expression.

    Args:
        expression: A Python-style arithmetic expression, e.g. "(3+4)*5".
    """
    return str(eval(expression, {"__builtins__": {}}, {}))
'''


@pytest.fixture(scope="module")
def gsm8k_tools_files(tmp_path_factory):
    """GSM8K in the tool-agent layout, as `posttrain prepare gsm8k --tools` writes it from the shared originals."""
    from posttrain.data.preprocess import prepare

    written = prepare("gsm8k", None, tmp_path_factory.mktemp("gsm8k_tools"), tools=True)
    return str(written["train"][0]), str(written["test"][0])


def tiny_knobs(run_dir) -> list[str]:
    """The size knobs the recorded scripts train with (SMALL), with prompts of up to 1024 tokens (the GSM8K example's
    own value) instead of 256: the tool-agent prompts (system prompt and question) take 500 to 1000 tokens of the tiny
    tokenizer's 512-word vocabulary."""
    sys.path.insert(0, str(ROOT / "tools"))
    from verl_examples import SMALL

    return [s.replace("STEPS", "2").replace("RUN_DIR", str(run_dir)) for s in SMALL
            if not s.startswith(("data.max_prompt_length=", "actor_rollout_ref.rollout.prompt_length="))] + [
        "data.max_prompt_length=1024", "actor_rollout_ref.rollout.prompt_length=1024"]


def trained_steps(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all("agent/turns/mean" in r for r in steps)  # episodes, not single responses
    return steps


def test_familiar_multi_turn_example_trains_two_steps(tmp_path, tiny_model_dir, gsm8k_tools_files, tracking_installed):
    """The GSM8K tool-agent example (config file, tool YAML, command line) with only the paths changed, plus the
    recorded scripts' size knobs, trains 2 steps on the tiny model over `prepare gsm8k --tools` data, and its tool
    YAML's class resolves to the built-in GSM8K tool, which scores a row's ground truth through the row's
    tools_kwargs."""
    from posttrain.agents.settings import AgentSettings
    from posttrain.agents.tool_agent import toolbox_for, tools_kwargs_of
    from posttrain.tools import parse_tool_calls
    from posttrain.data.dataset import read_rows
    from posttrain.tools.builtin.gsm8k import Gsm8kTool
    from posttrain.trainer.rl import run_rl

    train, test = gsm8k_tools_files
    (tmp_path / "gsm8k_multiturn_grpo.yaml").write_text(GSM8K_MULTITURN_YAML)
    (tmp_path / "gsm8k_tool_config.yaml").write_text(GSM8K_TOOL_YAML)
    args = (GSM8K_MULTITURN_ARGS.replace("data.val_files=DATA", f"data.val_files={test}")
            .replace("MODEL", str(tiny_model_dir)).replace("DATA", train)
            .replace("TOOLS", str(tmp_path / "gsm8k_tool_config.yaml")).split())
    config_file, base = hydra_config(str(tmp_path), "gsm8k_multiturn_grpo")
    cfg = load_config(config_file, base + args + tiny_knobs(tmp_path / "run"))
    tool = toolbox_for(AgentSettings.from_config(cfg)).tools["calc_gsm8k_reward"]
    assert type(tool) is Gsm8kTool
    row = read_rows(train)[0]
    assert row["agent_name"] == "tool_agent"
    session = toolbox_for(AgentSettings.from_config(cfg)).open(tools_kwargs_of(row))
    answer = json.dumps({"name": "calc_gsm8k_reward", "arguments": {"answer": row["reward_model"]["ground_truth"]}})
    call = f"<tool_call>{answer}</tool_call>"
    assert session.run(parse_tool_calls(call).calls)[0].error is None and session.reward() == 1.0
    session.close()
    run_rl(cfg)
    trained_steps(tmp_path / "run")


def test_familiar_multi_turn_docs_configuration_trains_two_steps(tmp_path, tiny_model_dir, gsm8k_tools_files,
                                                                 tracking_installed):
    """The multi-turn docs' configuration (function tools, tool_agent, async mode, its tokenization check) and the
    tool file they show, unchanged but for the paths, train 2 steps on the tiny model over `prepare gsm8k --tools`
    data; the docs' functions are the run's tools."""
    from posttrain.agents.settings import AgentSettings
    from posttrain.agents.tool_agent import toolbox_for
    from posttrain.tools import parse_tool_calls
    from posttrain.trainer.rl import run_rl

    train, test = gsm8k_tools_files
    (tmp_path / "your_tools.py").write_text(DOCS_TOOL_FILE)
    (tmp_path / "multiturn.yaml").write_text(DOCS_MULTITURN_YAML.replace("TOOL_FILE", str(tmp_path / "your_tools.py")))
    cfg = load_config(str(tmp_path / "multiturn.yaml"),
                      [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={train}",
                       f"data.val_files={test}", *tiny_knobs(tmp_path / "run")])
    settings = AgentSettings.from_config(cfg)
    assert (settings.default_agent_loop, settings.tokenization_sanity_check_mode) == ("tool_agent", "ignore_strippable")
    box = toolbox_for(settings)
    assert [s["function"]["name"] for s in box.schemas()] == ["get_weather", "calculator"]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "(3+4)*5"}}</tool_call>'
    assert box.open().run(parse_tool_calls(call).calls)[0].message["content"] == "35"
    run_rl(cfg)
    trained_steps(tmp_path / "run")


def test_hydra_flags_and_python_dash_m(tmp_path):
    assert hydra_config("config", "ppo_trainer.yaml") == (None, [])
    assert hydra_config("./config", "ppo_megatron_trainer")[1] == ["actor_rollout_ref.actor.strategy=megatron",
                                                                   "critic.strategy=megatron"]
    (tmp_path / "mine.yaml").write_text("trainer:\n  total_epochs: 3\n")
    assert hydra_config(str(tmp_path), "mine") == (str(tmp_path / "mine.yaml"), [])
    with pytest.raises(ConfigError, match="does not exist"):
        hydra_config(str(tmp_path), "other")
    out = subprocess.run([sys.executable, "-m", "posttrain", "train", "--config-path=config",
                          "--config-name=ppo_megatron_trainer", "--print-config", *OK,
                          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1"],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert "strategy: megatron" in out.stdout and "note: strategy=megatron" in out.stderr


def test_load_time_checks(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    message = rejects(OK + [f"data.train_files={tmp_path / 'missing.parquet'}", "trainer.logger=['console','mlflow']",
                            "actor_rollout_ref.model.path=./no_such_dir"])
    assert "missing.parquet' does not exist" in message and "posttrain[tracking]" in message
    assert "actor_rollout_ref.model.path='./no_such_dir'" in message


def test_override_config_names_unknown_field(tiny_model_dir):
    from posttrain.models.load import model_config

    cfg = model_config(str(tiny_model_dir), override_config={"attention_dropout": 0.25}, key="actor_rollout_ref.model.path")
    assert cfg.attention_dropout == 0.25
    with pytest.raises(ConfigError, match="override_config.atention_dropout: the model config .* has no field"):
        model_config(str(tiny_model_dir), override_config={"atention_dropout": 0.1}, key="actor_rollout_ref.model.path")


# The user's copies of reward files that verl's repository has (a script names them by their place in a verl
# checkout, a path the user changes when porting, as model and data paths). A reward file verl's repository does
# not have gets no copy, so its script stops at load saying the file does not exist.
VERL_REWARD_FILES = ROOT / "tests" / "data" / "verl_reward_files"


def _reward_file(arg: str) -> str:
    key, eq, value = arg.partition("=")
    if eq and key.lstrip("+").endswith("custom_reward_function.path") and "/verl/utils/reward_score/" in "/" + value:
        copy = VERL_REWARD_FILES / Path(value).name
        if copy.is_file():
            return f"{key}={copy}"
    return arg


def _script_argv(name, model, data, reward_model=None, folder=SCRIPTS, adapter="$LORA_ADAPTER_PATH"):
    record = json.loads((folder / name).read_text())
    argv = [_reward_file(a).replace("$REWARD_MODEL_PATH", reward_model or model).replace("$MODEL_PATH", model).replace("$TRAIN_FILES", data)
            .replace("$VAL_FILES", data).replace("$LORA_ADAPTER_PATH", adapter) for a in record["argv"]]
    hydra = {a.split("=")[0]: a.split("=", 1)[1] for a in argv if a.startswith("--config-")}
    return record["script"], hydra, [a for a in argv if not a.startswith("--config-")]


@pytest.fixture(scope="module")
def saved_adapter(tiny_model_dir, tmp_path_factory) -> str:
    """A LoRA adapter of the tiny model (rank 4, attention projections) saved by peft, its B matrices non-zero."""
    from posttrain.models.load import LoraSettings, load_causal_lm

    torch.manual_seed(3)
    model = LoraSettings(4, 8, "q_proj,v_proj").apply(load_causal_lm(str(tiny_model_dir)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    out = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    from posttrain.data.preprocess import prepare

    out = tmp_path_factory.mktemp("gsm8k")
    return str(prepare("gsm8k", None, out)["train"][0])


def _load_recorded(folder, model, data, adapter) -> tuple[list[str], dict[str, str]]:
    """Load every recording of a folder: the scripts that load, and the message of each that does not."""
    loaded, failed = [], {}
    for path in sorted(folder.glob("*.json")):
        script, hydra, overrides = _script_argv(path.name, model, data, folder=folder, adapter=adapter)
        config_file, base = hydra_config(hydra.get("--config-path"), hydra.get("--config-name", "").strip("'"))
        try:
            load_config(config_file, base + overrides)
            loaded.append(script)
        except ConfigError as e:
            failed[script] = str(e)
    return loaded, failed


def test_recorded_scripts_load_or_name_every_problem(tiny_model_dir, gsm8k_file, saved_adapter, tracking_installed,
                                                     vllm_installed):
    loaded, failed = _load_recorded(SCRIPTS, str(tiny_model_dir), gsm8k_file, saved_adapter)
    assert len(loaded) + len(failed) == 76
    assert set(failed) == set(NOT_LOADING), sorted(set(failed) ^ set(NOT_LOADING))
    for script, fragment in NOT_LOADING.items():
        assert fragment in failed[script], (script, failed[script])


def test_newest_tree_scripts_load_or_name_every_problem(tiny_model_dir, gsm8k_file, saved_adapter, tracking_installed,
                                                        vllm_installed):
    """The 90 main_ppo scripts of the newest tree: the count docs/porting.md reports load, and each of the others
    fails at load with one message naming its reasons."""
    loaded, failed = _load_recorded(NEWEST, str(tiny_model_dir), gsm8k_file, saved_adapter)
    assert (len(loaded), len(loaded) + len(failed)) == (78, 90), sorted(set(failed) ^ set(NOT_LOADING_2026))
    assert set(failed) == set(NOT_LOADING_2026), sorted(set(failed) ^ set(NOT_LOADING_2026))
    for script, fragments in NOT_LOADING_2026.items():
        for fragment in fragments:
            assert fragment in failed[script], (script, fragment, failed[script])
    doc = (ROOT / "docs" / "porting.md").read_text()
    assert f"**{len(loaded)} of {len(loaded) + len(failed)} load" in doc
    outside = [s for s in loaded + list(failed) if not s.startswith("ascend_extras/")]  # the Ascend NPU variants
    kept = sum(1 for s in loaded if not s.startswith("ascend_extras/"))
    assert (kept, len(outside)) == (75, 83) and f"{kept} of the {len(outside)} outside" in doc


@pytest.fixture(scope="module")
def tiny_reward_model(tmp_path_factory):
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_reward_model

    return str(build_tiny_reward_model(tmp_path_factory.mktemp("rm"), tokenizer_corpus(0, 200), seed=1))


@pytest.mark.parametrize("name", ["grpo_trainer__run_qwen2-7b.json", "gpg_trainer__run_qwen2-7b_math_megatron.json",
                                  "ppo_trainer__run_deepseek7b_llm.json",
                                  "ppo_trainer__run_qwen2-7b_rm_seq_balance.json",
                                  "grpo_trainer__run_qwen2_5-3b_gsm8k_grpo_lora_from_adapter.json",
                                  "2026_08/grpo_trainer__run_mistral_nemo_12b_skyworkrm_fsdp.json",
                                  "2026_08/gdpo_trainer__run_qwen3_8b_fsdp.json",
                                  "2026_08/rollout_correction__run_qwen2_5_7b_fsdp_multi_rs.json",
                                  "2026_08/rollout_correction__run_qwen2_5_7b_fsdp.json"])
def test_recorded_script_trains_two_steps(name, tiny_model_dir, tiny_reward_model, gsm8k_file, saved_adapter, tmp_path,
                                          tracking_installed):
    """The script's own keys plus small batch sizes on the tiny models: two steps run and log metrics (two score with
    a reward model, the newest tree's through its top-level reward block; one continues from a saved LoRA
    adapter; the gdpo one scores with the user's copy of verl's reward file through the gdpo reward manager; the
    multi_rs one rejects tokens in bypass mode's loss)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from verl_examples import SMALL

    from posttrain.trainer.rl import run_rl

    newest = name.startswith("2026_08/")
    script, hydra, overrides = _script_argv(name.removeprefix("2026_08/"), str(tiny_model_dir), gsm8k_file,
                                            tiny_reward_model, folder=NEWEST if newest else SCRIPTS,
                                            adapter=saved_adapter)
    config_file, base = hydra_config(hydra.get("--config-path"), hydra.get("--config-name", "").strip("'"))
    small = [s.replace("STEPS", "2").replace("RUN_DIR", str(tmp_path / "run")) for s in SMALL]
    # on posttrain's engine: a script's rollout.name=vllm needs vLLM (tests/test_vllm_train.py runs one on it)
    # one process: a Megatron line's pipeline ranks (row replicas) are set to one as its parallel sizes are
    one_process = [f"{a.split('=')[0]}=1" for a in overrides if "pipeline_model_parallel_size=" in a]
    cfg = load_config(config_file, base + overrides + small + one_process + ["data.train_max_samples=16",
                                                                             POSTTRAIN_ENGINE])
    run_rl(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    if "gdpo" in name:  # the scorer's two components reached the advantage (the stand-in needs experiment_name)
        assert all(r["reward/errors"] == 0 and "reward/format_reward/mean" in r and "reward/accuracy_reward/mean" in r
                   for r in rows if "actor/pg_loss" in r)
    if "multi_rs" in name:  # bypass mode's rejection sampling ran in the loss (token_k1, seq_max_k2)
        assert all("rollout_corr/rollout_rs_seq_max_k2_masked_fraction" in r for r in rows if "actor/pg_loss" in r)
    if name.endswith("_fsdp.json") and "rollout_correction" in name:  # REINFORCE with batch-normalised weights
        assert all("rollout_corr/rollout_is_batch_norm_factor" in r for r in rows if "actor/pg_loss" in r)
    if "_rm_" in name or "skyworkrm" in name:
        assert all("reward/rm_score/mean" in r for r in rows if "actor/pg_loss" in r)


DAPO = ROOT / "tests" / "data" / "dapo_scripts_2026_01"


@pytest.mark.parametrize("name", ["dapo__run_dapo_qwen2.5_32b.json", "dapo__test_dapo_7b_math.json"])
def test_dapo_long_response_script_trains_two_steps_with_sequence_parallel_on_two_processes(
        name, tiny_model_dir, gsm8k_file, tmp_path, vllm_installed):
    """verl's DAPO recipe scripts that split each sequence over Ulysses ranks (sequence-parallel size 8 on 128 GPUs,
    4 on 64) keep their own keys (dynamic sampling, overlong buffer, token-mean loss, dynamic batch sizes) and,
    with the recorded scripts' size knobs, the tiny model and GSM8K data, train 2 steps on 2 CPU processes with
    sequence-parallel size 2, the script's intent at the size 2 processes hold. As recorded, the 32B script loads;
    the 7B one is refused by name (its fsdp_size=32 asks for HSDP, which sequence parallel does not run)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from verl_examples import SMALL

    _, _, overrides = _script_argv(name, str(tiny_model_dir), gsm8k_file, folder=DAPO)
    sp = {a.split("=")[0]: int(a.split("=")[1]) for a in overrides if "ulysses_sequence_parallel_size" in a}
    assert sp and all(v >= 4 for v in sp.values())  # the scripts split sequences: the reduction keeps that
    config_file, base = hydra_config(None, "")
    if "fsdp_size=32" in " ".join(overrides):  # at its own size: HSDP groups of 32 with sequence parallel
        with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=4 with fsdp_config.fsdp_size=32"):
            load_config(config_file, base + overrides)
    else:
        load_config(config_file, base + overrides)  # as recorded, only the paths changed
    run = tmp_path / "run"
    small = [s.replace("STEPS", "2").replace("RUN_DIR", str(run)) for s in SMALL]
    two = ["trainer.n_gpus_per_node=2", "data.train_max_samples=16", "trainer.save_freq=2", POSTTRAIN_ENGINE,
           *(f"{key}=2" for key in sp)]
    result = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", *overrides, *small, *two],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, float))
    # the layout the run built: one data-parallel rank whose sequences are split over both processes (a trained
    # model that cannot split its rows is refused under that layout, so the run finishing means they were split)
    assert result.stderr.count("note: Ulysses sequence parallel: each sequence is split over 2 ranks (2 processes = "
                               "1 data-parallel x 2 sequence-parallel)") == 1, result.stderr[-3000:]
    assert sorted(p.name for p in (run / "global_step_2" / "actor").glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]  # FSDP shards over the data x sequence ranks
