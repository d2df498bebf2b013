"""`use_torch_compile`: the decoder layers compiled give eager's numbers (log-probs, gradients), compile once for
every layer and sequence length, leave decoding eager, fall back to eager with one warning when compilation fails,
and a training run with the key on (LoRA, gradient checkpointing, packed rows) follows the eager run."""

import json
import shutil
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from posttrain.models.compile import compile_decoder_layers, compiler_of
from posttrain.models.load import LoraSettings, load_causal_lm
from posttrain.models.policy import PolicyModel
from posttrain.parallel.shard import decoder_layers

# Inductor builds its CPU kernels with a C++ compiler; without one every compilation falls back to eager (tested).
needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                                    reason="no C++ compiler: torch.compile's CPU kernels cannot be built here")

# Compiled kernels fuse and reorder float32 arithmetic: agreement to rounding, not bit for bit.
ATOL = 2e-5
GRAD_RTOL = 1e-4


@pytest.fixture(autouse=True)
def fresh_compiler():
    """Each test compiles from scratch and counts its own graphs (dynamo's caches and recompile limit are per
    process)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def policies(path, **load):
    """An eager and a compiled policy with the same weights."""
    eager, compiled = (PolicyModel(load_causal_lm(str(path), **load)) for _ in range(2))
    compiled.load_state_dict(eager.state_dict())
    compile_decoder_layers(decoder_layers(compiled))
    return eager, compiled


def batch(rows, width, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (rows, width), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, : width // 3] = 0  # one left-padded prompt
    return ids, mask


def log_probs_and_grads(model, ids, mask, **kwargs):
    model.zero_grad()
    logp, entropy = model(ids, mask, response_length=6, **kwargs)
    (logp.sum() + 0.1 * entropy.sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach(), grads


def assert_close(eager, compiled):
    (lp_e, g_e), (lp_c, g_c) = eager, compiled
    assert torch.allclose(lp_e, lp_c, atol=ATOL, rtol=0)
    assert ((g_e - g_c).norm() / g_e.norm()).item() < GRAD_RTOL


@needs_compiler
def test_compiled_layers_give_eager_numbers_and_compile_once(lively_model_dir):
    eager, compiled = policies(lively_model_dir)
    assert type(decoder_layers(compiled)[0]).__name__ == "CompiledQwen2DecoderLayer"
    graphs = []
    for width, rows, seed in ((20, 4, 0), (27, 6, 1), (35, 3, 2)):  # three widths and batch sizes
        ids, mask = batch(rows, width, seed)
        assert_close(log_probs_and_grads(eager, ids, mask), log_probs_and_grads(compiled, ids, mask))
        graphs.append(counters["stats"]["unique_graphs"])
    # the graphs of the first call serve both layers and every later shape
    assert graphs[0] >= 1 and graphs == [graphs[0]] * 3
    with torch.no_grad():  # passes without gradients run eagerly
        ids, mask = batch(5, 24, 3)
        assert torch.equal(eager(ids, mask, response_length=6)[0], compiled(ids, mask, response_length=6)[0])
    assert counters["stats"]["unique_graphs"] == graphs[0]
    assert compiler_of(compiled).failure is None and compiler_of(eager) is None


def test_decoding_stays_eager_and_generates_as_eager(lively_model_dir, tiny_tokenizer):
    from posttrain.data.batch import Batch
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.registry import build_engine

    eager, compiled = policies(lively_model_dir)
    prompts = [tiny_tokenizer.encode(text) for text in ("2+3=", "7+1 is", "hello")]
    width = max(map(len, prompts))
    ids = torch.tensor([[tiny_tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    sampling = SamplingParams(n=2, do_sample=False, max_new_tokens=8)
    outputs = []
    for model in (eager, compiled):
        engine = build_engine("posttrain", model, tiny_tokenizer, device=torch.device("cpu"), dtype=torch.float32)
        outputs.append(engine.generate(Batch({"prompts": ids, "prompt_mask": mask}), sampling)["responses"])
    assert torch.equal(outputs[0], outputs[1])
    assert counters["stats"].get("unique_graphs", 0) == 0  # decoding runs eagerly


def test_a_failing_compilation_warns_once_and_runs_eagerly(lively_model_dir):
    def failing_backend(graph, inputs):
        raise RuntimeError("no compiler here")

    eager, compiled = policies(lively_model_dir)
    compiler = compiler_of(compiled)
    compiler.compiled = torch.compile(type(decoder_layers(eager)[0]).forward, backend=failing_backend)
    ids, mask = batch(3, 18, 7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = log_probs_and_grads(compiled, ids, mask)
        second = log_probs_and_grads(compiled, ids, mask)
    failed = [w for w in caught if "use_torch_compile" in str(w.message)]
    assert len(failed) == 1
    assert "no compiler here" in str(failed[0].message) and "runs eagerly" in str(failed[0].message)
    assert compiler.failure is not None
    expected = log_probs_and_grads(eager, ids, mask)
    for got in (first, second):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@needs_compiler
def test_training_with_use_torch_compile_follows_the_eager_run(small_task, tmp_path):
    """verl's key (`actor.use_torch_compile`, mapped onto `fsdp_config.use_torch_compile`) compiles the actor, here
    with LoRA and gradient checkpointing on the packed path (the reference is the same model, adapters off); the
    first step's numbers — losses, KL, gradient norm — match the eager run's."""
    from posttrain.config import load_config
    from posttrain.trainer.rl import RLTrainer

    out, files = small_task
    runs = {}
    for name, flag in (("eager", "False"), ("compiled", "True")):
        cfg = load_config(None, [
            "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "data.max_prompt_length=32",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.optim.lr=3e-4",
            "actor_rollout_ref.actor.use_kl_loss=True", f"actor_rollout_ref.actor.use_torch_compile={flag}",
            "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32",  # rounding of fp32 only
            f"actor_rollout_ref.model.path={out / 'sft'}", f"data.train_files={files['rl_train']}",
            "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / name}",
            "trainer.logger=['jsonl']",
            "trainer.val_before_train=False"])
        trainer = RLTrainer(cfg)
        trainer.fit()
        parts = trainer.parts
        compilers = [compiler_of(parts.actor.model), compiler_of(parts.reference.model)]
        assert all(c is not None for c in compilers) if flag == "True" else compilers == [None, None]
        assert all(c is None or c.failure is None for c in compilers)
        runs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    # (the watch's ratios divide step 1's rounding-sized KL by a floor: not a number of the step)
    first = {k: v for k, v in runs["eager"][0].items() if not k.startswith(("timing_s", "perf", "watch/"))}
    for key, value in first.items():
        if isinstance(value, float):
            assert runs["compiled"][0][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
    assert [m["step"] for m in runs["compiled"]] == [1, 2]


def test_the_default_compiles_fp32_models_of_twenty_million_parameters_on_a_cpu():
    from posttrain.models.compile import AUTO_FROM_PARAMETERS, compile_wanted

    small, large = (torch.nn.Linear(1000, n // 1000, bias=False, device="meta")
                    for n in (AUTO_FROM_PARAMETERS - 1000, AUTO_FROM_PARAMETERS))
    cpu, gpu, fp32, bf16 = torch.device("cpu"), torch.device("cuda"), torch.float32, torch.bfloat16
    assert not compile_wanted(None, small, cpu, fp32) and compile_wanted(None, large, cpu, fp32)
    assert not compile_wanted(None, large, cpu, bf16)  # bf16's training phase gained 2%: eager
    assert not compile_wanted(None, large, gpu, fp32)  # not measured on a GPU yet: eager
    assert compile_wanted(True, small, gpu, bf16) and not compile_wanted(False, large, cpu, fp32)  # a setting wins
