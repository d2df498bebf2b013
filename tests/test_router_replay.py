"""MoE router replay (models/router_replay.py, rollout/routing.py): on the tiny Qwen MoE models in float64, a
replayed forward is the model's forward with each router's choice forced (checked against routers rewritten with
plain loops, values and gradients), a record replays unchanged in another layout, the engine records what a forward
computes, and R2 / R3 train with the mismatch metric logged; the config keys and what is refused."""

import json

import pytest
import torch

from posttrain.config import ConfigError, config_warnings, load_config
from posttrain.models.load import load_causal_lm, load_tokenizer
from posttrain.models.logprobs import response_logprobs
from posttrain.models.router_replay import UNKNOWN, RoutingSession, routers, targets_of
from posttrain.models.shared_prompt import ATTENTION_NAME

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
F64 = torch.float64
ARCHS = ("qwen2_moe", "qwen3_moe")
OK = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_moe_model

    root = tmp_path_factory.mktemp("tiny_moe_replay")
    return {arch: build_tiny_moe_model(root / arch, tokenizer_corpus(0, 500), arch=arch, seed=0) for arch in ARCHS}


def f64_model(path):
    model = load_causal_lm(str(path)).to(F64).eval()
    model.config._experts_implementation = "eager"  # the grouped kernel takes no float64
    model.config._attn_implementation = ATTENTION_NAME  # sdpa, and the packed path for calls that pass `packed`
    return model


def rows_batch(seed=0):
    """Left-padded prompts and right-padded responses (4 rows, 11 columns, the last 5 the response)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (4, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :1] = 0
    mask[3, -2:] = 0
    mask[0, -1] = 0
    return ids * mask, mask


def forced_router(module, table, ids, mask):
    """The router with its top-k replaced by a loop over the call's tokens: for token (row, position) with a usable
    record (every expert known, none twice) the recorded experts, else the router's own top-k; weights: the router's
    probabilities (its own softmax, in float32 as transformers' router computes them) at the chosen experts,
    renormalised with norm_topk_prob."""
    T = ids.shape[1]

    def forward(hidden):
        hidden = hidden.reshape(-1, module.hidden_dim)
        logits = torch.nn.functional.linear(hidden, module.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        native = torch.topk(probs, module.top_k, dim=-1).indices
        weights, chosen = [], []
        for j in range(logits.shape[0]):
            row, col = divmod(j, T)
            pick = native[j].tolist()
            if mask[row, col]:
                position = int(mask[row, :col + 1].sum()) - 1
                target = [int(x) for x in table[row][position]] if position < len(table[row]) else [UNKNOWN]
                if min(target) >= 0 and len(set(target)) == len(target):
                    pick = target
            w = [probs[j, e] for e in pick]
            if module.norm_topk_prob:
                total = sum(w)
                w = [x / total for x in w]
            weights.append(torch.stack(w))
            chosen.append(pick)
        return logits, torch.stack(weights).to(logits.dtype), torch.tensor(chosen)

    return forward


def random_table(gen, lengths, layers, k, experts):
    """A record per row: random distinct experts, some positions unknown, one repeating an expert."""
    table = []
    for n in lengths:
        rec = torch.stack([torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(layers)])
                           for _ in range(n)])
        rec[torch.rand(n, generator=gen) < 0.2] = UNKNOWN
        if n > 2:
            rec[1, 0, :] = rec[1, 0, 0]  # an expert twice: the router's own choice stands
        table.append(rec)
    return table


def real_logits(model, ids, mask, packed: bool):
    """(real tokens, V) float64 logits of the rows' real tokens, row by row: one padded call, or the rows packed into
    one (models/packed.py)."""
    from posttrain.models.packed import mask_off, pack

    if not packed:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[mask.bool()]
    rows = pack(ids, mask)
    with mask_off():
        return model(input_ids=rows.input_ids, attention_mask=None, position_ids=rows.position_ids,
                     packed=rows.packing, use_cache=False).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_forward_is_the_forward_with_the_routers_choice_forced(moe_dirs, arch):
    """Float64 logits and the gradient of every parameter (the routers' weights included: softmax weights at the
    forced experts, as verl defines), in the padded and the packed layout, equal those of the routers rewritten as
    plain loops forcing the same choice at each (row, position)."""
    ids, mask = rows_batch()
    model = f64_model(moe_dirs[arch])
    gates = routers(model)
    layers, k, experts = len(gates), gates[0].top_k, gates[0].num_experts
    gen = torch.Generator().manual_seed(1)
    table = random_table(gen, mask.sum(-1).tolist(), layers, k, experts)
    coef = torch.randn(int(mask.sum()), model.config.vocab_size, generator=gen, dtype=F64)

    def value_and_grads(packed):
        model.zero_grad()
        logits = real_logits(model, ids, mask, packed)
        (torch.log_softmax(logits, -1) * coef).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    originals = [g.forward for g in gates]
    for layer, gate in enumerate(gates):
        gate.forward = forced_router(gate, [t[:, layer] for t in table], ids, mask)
    try:
        want, want_grads = value_and_grads(False)
    finally:
        for gate, forward in zip(gates, originals):
            gate.forward = forward
    native, _ = value_and_grads(False)
    assert (native - want).abs().max() > 1e-4  # the forced choice changes the forward
    for packed in (False, True):
        with RoutingSession(model, targets=targets_of(table)) as session:
            got, got_grads = value_and_grads(packed)
        assert torch.allclose(got, want, rtol=0, atol=1e-12), packed
        assert got_grads.keys() == want_grads.keys() and any("mlp.gate.weight" in n for n in got_grads)
        for name, grad in want_grads.items():
            assert torch.allclose(got_grads[name], grad, rtol=1e-10, atol=1e-12), (packed, name)
        assert 0 < session.mismatched < session.compared  # some forced choices were not the router's


def test_a_record_replays_as_the_native_forward_in_another_layout(moe_dirs):
    """Recorded on padded rows, replayed on packed ones (and back): the native forward exactly, no mismatch. A
    shared-prompt call is refused (one call per micro-batch)."""
    ids, mask = rows_batch(2)
    model = f64_model(moe_dirs["qwen2_moe"])
    with torch.no_grad():
        native = response_logprobs(model, ids, mask, 5, with_entropy=False)[0]
        with RoutingSession(model, record_width=ids.shape[1], rows=len(ids)) as rec:
            response_logprobs(model, ids, mask, 5, with_entropy=False, packed=True)
        records = rec.per_row(mask.sum(-1).tolist())
        assert all((r >= 0).all() for r in records)
        with RoutingSession(model, targets=targets_of(records)) as replay:
            again = response_logprobs(model, ids, mask, 5, with_entropy=False)[0]
        assert torch.equal(again, native) and replay.compared == 2 * sum(len(r) for r in records)
        assert replay.mismatched == 0
        prompts = (torch.tensor([0, 2]), torch.tensor([0, 0, 1, 1]))
        with RoutingSession(model, targets=targets_of(records)), pytest.raises(RuntimeError, match="one model call"):
            response_logprobs(model, ids, mask, 5, with_entropy=False, prompts=prompts)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_records_the_routing_of_every_token_it_computes(moe_dirs, arch):
    """R3's record: posttrain's engine (prompts prefilled in one call, or in several buckets, then decoding steps)
    gives, for every row and position, the experts a forward over the finished rows routes to, and no record for
    each row's last token (never fed back)."""
    from posttrain.data.batch import Batch
    from posttrain.models.policy import PolicyModel
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.engine import DecodeEngine
    from posttrain.rollout.prefill import prefill_buckets
    from posttrain.rollout.routing import generate_recording_routing

    model = f64_model(moe_dirs[arch])
    policy = PolicyModel(model)
    engine = DecodeEngine(policy, load_tokenizer(str(moe_dirs[arch])), device=torch.device("cpu"), dtype=F64)
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 200, (5, 9), generator=gen)
    pm = torch.ones_like(prompts)
    for row, pad in enumerate((0, 4, 1, 6, 2)):
        pm[row, :pad] = 0
    prompts = prompts * pm
    sampling = SamplingParams(n=2, do_sample=False, max_new_tokens=6, ignore_eos=True)
    out = generate_recording_routing(engine, Batch({"prompts": prompts, "prompt_mask": pm}, {"uid": list("abcde")}),
                                     sampling)
    assert len(prefill_buckets(pm.sum(-1), 0)) > 1  # the second run: prompts prefilled in several calls
    engine.routing_tables, engine.record_routing = [], True
    with torch.no_grad():
        engine._decode(policy, prompts, pm, sampling, call_cost=0, routing=True)
    engine.record_routing = False
    bucketed = engine.routing_tables[0]
    ids, mask = out["input_ids"], out["attention_mask"]
    with torch.no_grad(), RoutingSession(model, record_width=ids.shape[1], rows=len(ids)) as full:
        response_logprobs(model, ids, mask, 6, with_entropy=False)
    lengths = mask.sum(-1).tolist()
    for row, (record, want) in enumerate(zip(out.meta["routed_experts"], full.per_row(lengths))):
        assert record.shape == want.shape == (lengths[row], 2, 2)
        assert (record[-1] == UNKNOWN).all() and (record[:-1] >= 0).all()
        assert torch.equal(record[:-1], want[:-1]), row
        assert torch.equal(bucketed[row, :lengths[row]].to(torch.int16), record), row


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from posttrain.data.synthetic import write_task

    return write_task(tmp_path_factory.mktemp("replay_task") / "data", seed=0, operands=range(0, 10), held_out=0,
                      dev=10, copies=4)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_r2_and_r3_train_the_tiny_moe_and_log_the_mismatch(moe_dirs, task, tmp_path, mode):
    """Two GRPO steps with router replay (activation checkpointing on: the backward pass recomputes replayed
    layers), two mini-batches a step: the update's share of replayed (token, layer) pairs the router would have
    sent elsewhere is logged (the first mini-batch replays the routing of the weights it was recorded with), and
    with R3 the old-log-prob pass's share too (the rollout's routing against the trainer's)."""
    from posttrain.trainer.rl import RLTrainer

    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=32",
        "data.max_response_length=6", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        f"actor_rollout_ref.model.path={moe_dirs['qwen2_moe']}", f"data.train_files={task['rl_train']}",
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=['jsonl']", "trainer.val_before_train=False",
        "reward_model.num_workers=0", "trainer.total_training_steps=2", "trainer.save_freq=-1",
        f"actor_rollout_ref.actor.router_replay.mode={mode}",
        f"actor_rollout_ref.rollout.enable_rollout_routing_replay={mode == 'R3'}"])
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["actor/router_replay/mismatch"] < 1.0
        assert ("actor/router_replay/old_log_prob_mismatch" in r) == (mode == "R3")
        assert 0.0 <= r.get("actor/router_replay/old_log_prob_mismatch", 0.0) < 0.5


def test_config_keys_spellings_and_what_is_refused(tmp_path):
    rr, record = "actor_rollout_ref.actor.router_replay.mode", "actor_rollout_ref.rollout.enable_rollout_routing_replay"
    for spelling in ("actor_rollout_ref.actor.megatron.router_replay.mode",
                     "actor_rollout_ref.actor.veomni.router_replay.mode", rr):
        assert load_config(None, OK + [f"{spelling}=R2"]).actor_rollout_ref.actor.router_replay.mode == "R2"
    cfg = load_config(None, OK + [f"{rr}=R3", f"{record}=True"])
    assert cfg.actor_rollout_ref.rollout.enable_rollout_routing_replay
    assert any("nothing replays" in n for n in config_warnings(load_config(None, OK + [f"{record}=True"])))
    for keys, fragment in (
            ([f"{rr}=R4"], "is not one of"),
            ([f"{rr}=R3"], f"R3 replays the routing the rollout records, which {record}=True"),
            ([f"{rr}=R2", f"{record}=True"], "R2 records it in the old-log-prob pass"),
            ([f"{rr}=R3", f"{record}=True", "actor_rollout_ref.rollout.multi_turn.enable=True"],
             "R3 with multi-turn episodes"),
            ([f"{rr}=R3", f"{record}=True", "actor_rollout_ref.rollout.name=hf"], "transformers' generate"),
            ([f"{rr}=R2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"],
             "not run under sequence parallel"),
            (["actor_rollout_ref.ref.router_replay.mode=R2"], "the reference routes each token itself"),
            ([f"actor_rollout_ref.actor.router_replay.record_file={tmp_path}"], "travel with the batch in memory")):
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            load_config(None, OK + keys)


def test_a_dense_model_is_refused_when_the_actor_is_built(tiny_model_dir):
    from posttrain.parallel import Parallel
    from posttrain.trainer.setup import Roles

    cfg = load_config(None, OK + [f"actor_rollout_ref.model.path={tiny_model_dir}",
                                  "actor_rollout_ref.actor.router_replay.mode=R2"])
    with pytest.raises(ConfigError, match="router_replay.mode=R2: .* has no MoE router"):
        Roles(cfg, Parallel(), None, 1)
