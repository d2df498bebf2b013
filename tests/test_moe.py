"""Mixture-of-experts models (Qwen2-MoE with a shared expert, Qwen3-MoE) train end to end: built offline, loaded the
usual way, decoded by posttrain's engine, their log-probs right on the shared-prompt path too, the router's
load-balancing loss the model's own and added to the actor's loss as the model's config asks, router metrics logged,
tensor parallel refused before any model loads, and a GRPO run from an SFT warm start that learns."""

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.models.load import load_causal_lm
from posttrain.models.moe import RouterRecorder, moe_spec
from posttrain.models.policy import PolicyModel
from posttrain.models.shared_prompt import prompt_groups
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine
from posttrain.rollout.transformers_generate import TransformersGenerate
from posttrain.trainer.rl import RLTrainer
from tests.test_rl_integration import read_metrics
from tests.test_roles_rollout import prompts_batch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CPU = torch.device("cpu")
ARCHS = ("qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory):
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_moe_model

    root = tmp_path_factory.mktemp("tiny_moe")
    return {arch: build_tiny_moe_model(root / arch, tokenizer_corpus(0, 500), arch=arch, seed=0) for arch in ARCHS}


def _ids(batch=4, length=9, vocab=200, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[2:, :3] = 0  # left padding
    mask[1, -2:] = 0  # a shorter response
    return ids * mask, mask


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_moe_is_the_transformers_moe_model(moe_dirs, arch):
    from transformers import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

    model = load_causal_lm(str(moe_dirs[arch]))
    assert isinstance(model, {"qwen2_moe": Qwen2MoeForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}[arch])
    spec = moe_spec(model)
    assert (spec.num_experts, spec.top_k, spec.aux_on) == (4, 2, True)
    assert spec.aux_coef == model.config.router_aux_loss_coef > 0
    layer = model.model.layers[0].mlp
    assert layer.experts.gate_up_proj.shape[0] == 4  # experts packed into one fused parameter
    assert hasattr(layer, "shared_expert") == (arch == "qwen2_moe")
    assert moe_spec(load_causal_lm(str(moe_dirs[arch]), override_config={"output_router_logits": False})).aux_on \
        is False


@pytest.mark.parametrize("arch", ARCHS)
def test_aux_loss_is_the_models_own_and_shared_prompts_give_the_same_log_probs(moe_dirs, arch):
    torch.manual_seed(0)
    policy = PolicyModel(load_causal_lm(str(moe_dirs[arch])))
    ids, mask = _ids()
    spec = moe_spec(policy.lm)
    with torch.no_grad():
        plain = RouterRecorder(spec)
        logp, _ = policy(ids, mask, 4, with_entropy=False, router=plain)
        own = policy.lm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        assert torch.allclose(plain.aux_loss(), own.aux_loss, atol=1e-6)  # masked to the real tokens, as the model
        # rows 0/1 share a prompt, rows 2/3 another: each distinct prompt is computed once
        ids[1, :5], ids[3, :5] = ids[0, :5], ids[2, :5]
        groups = prompt_groups(["a", "a", "b", "b"])
        logp, _ = policy(ids, mask, 4, with_entropy=False)
        shared_rec = RouterRecorder(spec)
        shared, _ = policy(ids, mask, 4, with_entropy=False, prompts=groups, router=shared_rec)
    assert policy.shared_prompt_ok is True
    assert torch.allclose(logp, shared, atol=1e-5)
    # each distinct prompt ran once, its tokens weighted by the rows that share it: the plain forward's aux loss
    assert [call[0].shape[0] for call in shared_rec.logits] == [2 * 5, 4 * 4]
    plain = RouterRecorder(spec)
    with torch.no_grad():
        policy(ids, mask, 4, with_entropy=False, router=plain)
    assert torch.allclose(shared_rec.aux_loss(), plain.aux_loss(), atol=1e-6)
    assert torch.allclose(shared_rec.load(), plain.load(), atol=1e-6)
    load = shared_rec.load()
    assert load.shape == (2, 4) and torch.allclose(load.sum(-1), torch.ones(2))


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_give_the_padded_log_probs_and_router_loss(moe_dirs, arch):
    """`use_remove_padding` on a MoE model: the router logits of the real tokens only, so the aux loss and the
    expert load are the padded forward's (masked to the real tokens) as well as the log-probs."""
    torch.manual_seed(0)
    policy = PolicyModel(load_causal_lm(str(moe_dirs[arch])))
    ids, mask = _ids()
    spec = moe_spec(policy.lm)
    padded, packed = RouterRecorder(spec), RouterRecorder(spec)
    with torch.no_grad():
        want, _ = policy(ids, mask, 4, with_entropy=False, router=padded)
        got, _ = policy(ids, mask, 4, with_entropy=False, router=packed, packed=True)
    assert policy.packed_ok is True
    assert [call[0].shape[0] for call in packed.logits] == [int(mask.sum())]
    real = mask[:, -4:].bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed.aux_loss(), padded.aux_loss(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(packed.load(), padded.load(), rtol=1e-5, atol=1e-7)
    # rows 0/1 share a prompt, rows 2/3 another: each packed prompt runs once, its tokens weighted by its sharers
    ids[1, :5], ids[3, :5] = ids[0, :5], ids[2, :5]
    padded, shared = RouterRecorder(spec), RouterRecorder(spec)
    with torch.no_grad():
        want, _ = policy(ids, mask, 4, with_entropy=False, router=padded)
        got, _ = policy(ids, mask, 4, with_entropy=False, router=shared, packed=True,
                        prompts=prompt_groups(["a", "a", "b", "b"]))
    assert policy.shared_prompt_ok is True
    assert [call[0].shape[0] for call in shared.logits] == [5 + 2, int(mask[:, -4:].sum())]
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shared.aux_loss(), padded.aux_loss(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(shared.load(), padded.load(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ARCHS)
def test_decoding_engine_runs_moe_models_and_matches_generate(moe_dirs, tiny_tokenizer, arch):
    """posttrain's engine passes its own logits check on both MoE models (no fallback), and greedy decoding gives
    the tokens of transformers' generate, which runs with the router loss switched on in the config."""
    model = load_causal_lm(str(moe_dirs[arch]))
    batch = prompts_batch(tiny_tokenizer, ["1+2=", "33+44="])
    greedy = SamplingParams(n=2, max_new_tokens=6, temperature=0.0)
    engine = DecodeEngine(model, tiny_tokenizer, device=CPU, dtype=torch.float32)
    ours = engine.generate(batch, greedy)
    assert engine.shared_prefix_ok is True
    theirs = TransformersGenerate(model, tiny_tokenizer, device=CPU, dtype=torch.float32).generate(batch, greedy)
    assert torch.equal(ours["responses"], theirs["responses"])


def test_upcycled_moe_computes_what_the_dense_model_computes(tiny_model_dir, tmp_path):
    from posttrain.models.tiny import upcycle_to_moe

    dense = load_causal_lm(str(tiny_model_dir))
    moe = load_causal_lm(str(upcycle_to_moe(tiny_model_dir, tmp_path / "moe", num_experts=4, top_k=2)))
    assert moe_spec(moe).num_experts == 4 and moe.model.layers[0].mlp.gate.weight.abs().sum() > 0
    ids, mask = _ids()
    with torch.no_grad():
        want, got = (m(input_ids=ids, attention_mask=mask).logits for m in (dense, moe))
    assert torch.allclose(got, want, atol=1e-5)


def _rl_config(tmp, model_dir, files, *extra):
    return load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "data.max_prompt_length=32",
        "data.max_response_length=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={files['rl_train']}",
        f"trainer.default_local_dir={tmp}", "trainer.logger=['jsonl']", "trainer.val_before_train=False",
        "reward_model.num_workers=0", *extra])


@pytest.fixture(scope="module")
def moe_task(tmp_path_factory):
    from posttrain.data.synthetic import write_task

    out = tmp_path_factory.mktemp("moe_task")
    return out, write_task(out / "data", seed=0, operands=range(0, 10), held_out=0, dev=10, copies=8)


def test_tensor_parallel_with_moe_is_refused_before_loading(moe_dirs, moe_task, tmp_path):
    out, files = moe_task
    cfg = _rl_config(tmp_path / "run", moe_dirs["qwen2_moe"], files, "actor_rollout_ref.actor.fsdp_config.tp_size=2",
                     "trainer.n_gpus_per_node=2")
    from posttrain.parallel import Parallel
    from posttrain.trainer.setup import Roles

    with pytest.raises(ConfigError, match="tp_size=2: the model is a mixture-of-experts model"):
        Roles(cfg, Parallel(), None, 1)  # refused before the first model is built (no process group needed)


def _scored_batch(model_dir, tokenizer, scores):
    """4 prompts x 4 sampled responses of the model, with the given 0/1 score per response."""
    from posttrain.data.dataset import layout_row

    rows = [layout_row("synthetic/arithmetic", f"{a}+{a + 3}=", str(2 * a + 3), {"index": a}) for a in range(4)]
    from posttrain.rollout.routing import generate_recording_routing

    torch.manual_seed(0)
    engine = DecodeEngine(load_causal_lm(str(model_dir)), tokenizer, device=CPU, dtype=torch.float32)
    batch = generate_recording_routing(engine, prompts_batch(tokenizer, [r["prompt"][0]["content"] for r in rows]),
                                       SamplingParams(n=4, max_new_tokens=8))  # with R3's routing record
    n = len(batch)
    token_scores = torch.zeros(batch["responses"].shape)
    token_scores[torch.arange(n), batch["response_mask"].sum(-1) - 1] = scores
    batch["token_level_scores"] = token_scores
    batch.meta.update({"data_source": ["synthetic/arithmetic"] * n, "ground_truth": ["0"] * n, "extra_info": [{}] * n,
                       "reward:acc": scores.tolist(), "reward:score": scores.tolist()})
    return batch


@pytest.mark.parametrize("aux_on", [True, False])
def test_router_loss_is_added_as_the_model_config_asks(moe_dirs, moe_task, tiny_tokenizer, tmp_path, aux_on):
    """Equal scores give zero GRPO advantages, so the policy loss has no gradient: the update's gradient is the
    router loss's alone — `router_aux_loss_coef` times the model's own aux loss over the batch's real tokens (one
    micro-batch) — and nothing at all when the config turns the router loss off."""
    out, files = moe_task
    model_dir = moe_dirs["qwen2_moe"]
    extra = [] if aux_on else ["+actor_rollout_ref.model.override_config.output_router_logits=False"]
    cfg = _rl_config(tmp_path / "run", model_dir, files, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.model.dtype=fp32",
                     "actor_rollout_ref.rollout.dtype=fp32", *extra)
    trainer = RLTrainer(cfg)
    trainer.global_step = 1
    batch = _scored_batch(model_dir, tiny_tokenizer, torch.zeros(16))
    metrics = trainer.learn(batch)
    assert metrics["actor/pg_loss"] == 0.0
    lm = load_causal_lm(str(model_dir))
    mask = batch["attention_mask"]
    aux = lm(input_ids=batch["input_ids"], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).aux_loss
    assert metrics["actor/moe/aux_loss"] == pytest.approx(float(aux), rel=1e-4)
    assert 1.0 <= metrics["actor/moe/load_imbalance"] <= metrics["actor/moe/load_imbalance_worst_layer"] <= 4.0
    if aux_on:
        (lm.config.router_aux_loss_coef * aux).backward()
        want = torch.sqrt(sum((p.grad ** 2).sum() for p in lm.parameters() if p.grad is not None))
        assert metrics["actor/grad_norm"] == pytest.approx(float(want), rel=1e-3)
    else:
        assert metrics["actor/grad_norm"] == 0.0


@pytest.mark.parametrize("arch,extra", [
    ("qwen2_moe", ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.model.enable_gradient_checkpointing=True"]),
    ("qwen3_moe", ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3"]),
])
def test_moe_trains_end_to_end(moe_dirs, moe_task, tmp_path, arch, extra):
    """Two GRPO steps (rollout, reward, old and reference log-probs, update; activation checkpointing on) and two
    PPO steps (with a critic on the MoE backbone) run, log router metrics and change the experts and the router."""
    out, files = moe_task
    cfg = _rl_config(tmp_path / "run", moe_dirs[arch], files, "trainer.total_training_steps=2", "trainer.save_freq=2",
                     *extra)
    RLTrainer(cfg).fit()
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    for m in metrics:
        assert all(torch.isfinite(torch.tensor(v)) for k, v in m.items() if k.startswith("actor/"))
        assert m["actor/moe/aux_loss"] > 0 and m["actor/moe/load_imbalance"] >= 1.0
        if "critic" in " ".join(extra):
            assert "critic/vf_loss" in m
        else:
            assert "actor/kl_loss" in m
    from posttrain.trainer.export import export_checkpoint

    exported = export_checkpoint(tmp_path / "run" / "global_step_2", tmp_path / "hf")
    before, after = (load_causal_lm(str(d)) for d in (moe_dirs[arch], exported))
    before, after = before.state_dict(), after.state_dict()
    assert before.keys() == after.keys()
    for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                "model.layers.0.mlp.gate.weight"):
        assert not torch.equal(before[key], after[key]), key


DIST_CASES = {
    # micro-batches of one prompt group: the same groups make up each micro-batch at 1 and 2 processes, so the
    # router loss (a per-micro-batch quantity, not additive over tokens) is the same sum
    "grpo_kl": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True"],
    "ppo": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "critic.ppo_micro_batch_size_per_gpu=4"],
    # router replay: R2 records in the old-log-prob pass (each rank its rows), R3 replays the rollout's record
    "grpo_r2": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.router_replay.mode=R2"],
    "grpo_r3": ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.router_replay.mode=R3",
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"],
}


def _run_workers(root, model_dir, batch_path, data_file, name, nproc):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = root / name
    out.mkdir()
    base = [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data_file}", "data.train_batch_size=4",
            "data.max_prompt_length=64", "data.max_response_length=8", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.model.dtype=fp32",
            "actor_rollout_ref.rollout.dtype=fp32", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "trainer.logger=['jsonl']", f"trainer.default_local_dir={out / 'run'}", f"trainer.n_gpus_per_node={nproc}"]
    (out / "spec.json").write_text(json.dumps({"base": base, "cases": DIST_CASES, "batch": str(batch_path),
                                               "out": str(out)}))
    worker = Path(__file__).with_name("dist_worker.py")
    cmd = [sys.executable, str(worker), str(out / "spec.json")] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(worker),
        str(out / "spec.json")]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_two_processes_equal_one_with_experts_sharded(moe_dirs, tiny_tokenizer, tmp_path):
    """FSDP2 over 2 processes (gloo, CPU) shards every expert of every decoder layer (the fused expert weights
    split along the expert dimension) and gives the one-process update: GRPO with the KL loss and the router loss,
    PPO with a MoE critic, and GRPO with router replay R2 and R3, compared metric by metric (router metrics and the
    replay's mismatch included) and weight by weight, at the tolerances of tests/test_distributed.py."""
    import json

    from tests.same_update import assert_same_training

    from posttrain.data.dataset import layout_row

    model_dir = moe_dirs["qwen2_moe"]
    rows = [layout_row("synthetic/arithmetic", f"{a}+{a + 3}=", str(2 * a + 3), {"index": a}) for a in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch = _scored_batch(model_dir, tiny_tokenizer, (torch.rand(16, generator=torch.Generator().manual_seed(0)) > 0.5)
                          .float())
    torch.save(batch, tmp_path / "batch.pt")
    one, two = (_run_workers(tmp_path, model_dir, tmp_path / "batch.pt", tmp_path / "train.jsonl", name, n)
                for name, n in (("one", 1), ("two", 2)))
    for case in DIST_CASES:
        want, got = torch.load(one / f"{case}.pt"), torch.load(two / f"{case}.pt")
        assert "actor/moe/aux_loss" in want["metrics"] and want["metrics"]["actor/grad_norm"] > 0
        assert ("actor/router_replay/mismatch" in want["metrics"]) == case.startswith("grpo_r")
        for key, value in want["metrics"].items():
            if key.startswith(("actor/", "critic/")) and not key.startswith("actor/lr"):
                assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (case, key)
        assert_same_training(want, got, case)
        shards = got["local_shapes"]["actor"]
        experts = [name for name in shards if "mlp.experts." in name]
        assert len(experts) == 2 * 2  # gate_up_proj and down_proj of both layers
        for name in experts:  # 4 experts over 2 ranks: 2 each
            assert shards[name][0] == 2, (name, shards[name])
        assert want["local_shapes"] == {role: {} for role in want["local_shapes"]}  # one process: nothing sharded



@pytest.mark.slow
def test_grpo_with_an_upcycled_moe_learns(small_task, tmp_path):
    """The small task's SFT checkpoint (tests/conftest.py: one-digit addition, 70% of demonstrations drop the
    carry) upcycled into a 4-expert top-2 Qwen2-MoE (the same function; the router random) trains with seeded GRPO,
    the router loss on, and its training reward rises as tests/test_learning.py asks of the dense families: the mean
    score of the last 10 of 30 steps beats that of the first 4 by at least 0.07 (measured: 0.253 -> 0.391). The 30
    steps took 22 s on the 2-core CPU when it was quiet (0.7 s a step), several minutes when other jobs shared it;
    the SFT checkpoint is the session fixture the dense learning tests use."""
    from posttrain.models.tiny import upcycle_to_moe
    from tests.test_rl_integration import rl_config

    out, files = small_task
    moe = upcycle_to_moe(out / "sft", tmp_path / "sft", num_experts=4, top_k=2, seed=0)
    RLTrainer(rl_config(tmp_path, files, "learn", 30, "reward_model.num_workers=0")).fit()
    metrics = read_metrics(tmp_path / "learn")
    assert load_causal_lm(str(moe)).config.model_type == "qwen2_moe"
    scores = [m["critic/score/mean"] for m in metrics]
    first, last = sum(scores[:4]) / 4, sum(scores[-10:]) / 10
    assert last > first + 0.07, [round(s, 3) for s in scores]
    assert all(m["actor/moe/aux_loss"] > 0 for m in metrics)


def test_moe_models_decode_without_cuda_graphs(moe_dirs, tiny_model_dir):
    """A MoE model's expert loop asks the CPU which experts were hit (`nonzero`), which a CUDA graph cannot record:
    the engine would decode it eagerly on a GPU; a dense model gets graphs. (Building an engine touches no device.)"""
    from posttrain.models.load import load_tokenizer

    cuda = torch.device("cuda")
    for path, graphs in [(moe_dirs[ARCHS[0]], False), (tiny_model_dir, True)]:
        engine = DecodeEngine(load_causal_lm(str(path)), load_tokenizer(str(path)), device=cuda, dtype=torch.float32)
        assert engine.cuda_graphs is graphs
        assert DecodeEngine(load_causal_lm(str(path)), load_tokenizer(str(path)), device=cuda, dtype=torch.float32,
                            cuda_graphs=False).cuda_graphs is False
