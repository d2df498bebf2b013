"""Asynchronous RL's weight sync between two real processes (gloo): exchanges of whole models and of adapters,
pushes that land mid-generation and mid-episode, and the merged decoding copy refreshed after a push. The two-group
runs of `posttrain train` are in tests/test_async_rl.py."""

import os
import sys
from pathlib import Path

import pytest

from tests.test_distributed import run_processes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]


def _run_two(script_text: str, folder: Path, *args, timeout: int = 180) -> None:
    """`script_text` run as two processes over gloo (rank 0 trains, rank 1 generates) with `folder` and `args` as
    its arguments; the repository root leads their path, so the scripts import tests.async_worker."""
    script = folder / "worker.py"
    script.write_text(script_text)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(folder), *map(str, args)]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    result = run_processes(cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]


SYNC_SCRIPT = """
import json, sys
import torch
from posttrain.parallel.context import exit_process, shutdown
from posttrain.parallel.groups import join
from posttrain.parallel.weight_sync import STOP, WeightSync, trainable_tensors

out = sys.argv[1]
groups = join(device_name="cpu", timeout_s=120)
for mode in ("full", "lora"):  # one exchange after the other over the same groups
    lora = mode == "lora"
    torch.manual_seed(100 + groups.rank)  # each side starts from different weights
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3, bias=False)).to(torch.float32)
    model[1].to(torch.bfloat16)  # two dtypes in one push
    if lora:  # the base frozen: only the "adapter" (second layer) trains
        model[0].requires_grad_(False)
    frozen_before = model[0].weight.detach().clone()
    sync = WeightSync(trainable_tensors(model), src=0, bucket_bytes=64)  # several buckets
    versions = []
    for version in (1, 2):
        if groups.trains:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))  # an "update"
            sync.push(version)
        else:
            versions.append(sync.receive())
    stopped = sync.receive() if not groups.trains else sync.push(STOP)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"state": state, "versions": versions, "names": sync.names, "bytes": sync.bytes, "stopped": stopped,
                "frozen_kept": bool(torch.equal(frozen_before, model[0].weight))}, f"{out}/{mode}_rank{groups.rank}.pt")
shutdown()
exit_process(0)
"""


@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory):
    """One launch of two processes that exchange weights twice over the same groups: every parameter trainable
    ("full"), then a frozen base ("lora"). {mode: [sender's result, receiver's result]}."""
    import torch

    out = tmp_path_factory.mktemp("sync")
    _run_two(SYNC_SCRIPT, out)
    return {mode: [torch.load(out / f"{mode}_rank{r}.pt") for r in range(2)] for mode in ("full", "lora")}


def test_weight_sync_makes_the_receiver_equal_the_sender_bit_for_bit_with_increasing_versions(sync_runs):
    """After each push the receiver holds the sender's weights exactly (float32 and bfloat16 tensors, several
    buckets), records the versions in order, and a STOP header ends the exchange without weights."""
    import torch

    sender, receiver = sync_runs["full"]
    assert receiver["versions"] == [1, 2]
    assert receiver["stopped"] == -1
    assert sender["state"].keys() == receiver["state"].keys()
    for name, want in sender["state"].items():
        got = receiver["state"][name]
        assert got.dtype == want.dtype
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), name
    assert receiver["names"] == ["0.bias", "0.weight", "1.weight"]


def test_weight_sync_with_a_frozen_base_sends_only_the_trainable_tensors(sync_runs):
    """LoRA-like: only the trainable tensors travel (their bytes alone), the frozen ones keep each side's own
    values, and the trainable ones arrive exactly."""
    import torch

    sender, receiver = sync_runs["lora"]
    assert receiver["names"] == ["1.weight"]
    assert receiver["bytes"] == 7 * 3 * 2  # bf16 (3, 7)
    assert torch.equal(receiver["state"]["1.weight"], sender["state"]["1.weight"])
    assert receiver["frozen_kept"]
    assert not torch.equal(receiver["state"]["0.weight"], sender["state"]["0.weight"])  # never sent


PARTIAL_SCRIPT = """
import math, sys
import torch
from posttrain.algo.staleness import staleness_metrics
from posttrain.data.batch import Batch
from posttrain.models.load import load_causal_lm, load_tokenizer
from posttrain.parallel.context import exit_process, shutdown
from posttrain.parallel.groups import join, recv_object, send_object
from posttrain.parallel.weight_sync import STOP, WeightSync, trainable_tensors
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine
from posttrain.trainer.async_rl import WeightInbox
from tests.async_worker import hold_until_push

out, path, swap_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
groups = join(device_name="cpu", timeout_s=120)
model = load_causal_lm(path)
tensors = trainable_tensors(model)
norm = [n for n in tensors if n.endswith("norm.weight") and "layers" not in n][0]
if groups.trains:
    sync = WeightSync(tensors, src=0)
    assert recv_object(1, groups.objects) == "decoding"
    with torch.no_grad():
        tensors[norm].zero_()  # version 1: every logit 0, so each token it samples has log-prob -log(V)
    sync.push(1)
    batch = recv_object(1, groups.objects)
    sync.push(STOP)
    metrics = staleness_metrics(batch["rollout_versions"], batch["response_mask"], trainer_version=1)
    torch.save({"batch": batch, "metrics": metrics, "vocab": model.config.vocab_size}, f"{out}/result.pt")
else:
    engine = DecodeEngine(model, load_tokenizer(path), device=torch.device("cpu"), dtype=torch.float32)
    inbox = WeightInbox(model, 512 << 20, 60)
    engine.between_steps = hold_until_push(inbox, groups, swap_at)  # the push lands mid-generation
    prompts = torch.tensor([[5, 6, 7], [8, 9, 10]])
    torch.manual_seed(0)
    batch = engine.generate(Batch({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)}, {}),
                            SamplingParams(n=2, max_new_tokens=8, ignore_eos=True, logprobs=True))
    send_object(Batch({k: batch[k] for k in ("responses", "response_mask", "rollout_versions", "rollout_log_probs")},
                      {}), 0, groups.objects)
    inbox.thread.join(60)
    assert inbox.stopped and inbox.current == 1
shutdown()
exit_process(0)
"""


def test_a_push_that_lands_mid_generation_is_decoded_with_and_tokens_keep_the_version_their_keys_saw(tmp_path,
                                                                                                     tiny_model_dir):
    """Partial rollouts: weights pushed while a batch decodes are swapped in between two decoding steps, so the
    tokens after the swap are sampled by the new weights (their recorded behaviour log-prob is -log(V): version 1
    makes every logit 0) over keys and values version 0 computed; `rollout_versions` labels every token with the
    oldest weights it attended to (the prompt's prefill, version 0), so the staleness metrics at trainer version 1
    say 1 for every token, those sampled after the swap included."""
    import math

    import torch

    _run_two(PARTIAL_SCRIPT, tmp_path, tiny_model_dir, 3)  # the 3rd call: before the step that samples token 2
    got = torch.load(tmp_path / "result.pt", weights_only=False)
    batch, metrics = got["batch"], got["metrics"]
    assert batch["response_mask"].shape == (4, 8) and bool(batch["response_mask"].all())
    assert batch["rollout_versions"].tolist() == [[0] * 8] * 4  # every token attended to the prompt's keys (v0)
    logprobs = batch["rollout_log_probs"].double()
    uniform = -math.log(got["vocab"])
    assert torch.allclose(logprobs[:, 2:], torch.full((4, 6), uniform, dtype=torch.float64), atol=1e-4)
    assert not torch.allclose(logprobs[:, :2], torch.full((4, 2), uniform, dtype=torch.float64), atol=1e-3)
    assert metrics["async/staleness_max"] == 1 and metrics["async/staleness_le_0"] == 0
    assert metrics["async/staleness_mean"] == 1


EPISODES_SCRIPT = """
import sys
import torch
from posttrain.agents.environment import Reset, Step
from posttrain.agents.loop import EpisodeRunner
from posttrain.agents.settings import AgentSettings
from posttrain.agents.template import Template
from posttrain.models.load import LoraSettings, load_causal_lm, load_tokenizer
from posttrain.models.policy import PolicyModel
from posttrain.parallel.context import exit_process, shutdown
from posttrain.parallel.groups import join, recv_object, send_object
from posttrain.parallel.weight_sync import STOP, WeightSync, trainable_tensors
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.engine import DecodeEngine
from posttrain.trainer.async_rl import WeightInbox
from tests.async_worker import hold_until_push

out, path, swap_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
groups = join(device_name="cpu", timeout_s=120)
tok = load_tokenizer(path)
TARGET = "layers.1.mlp.down_proj"  # the last layer's output: no key or value depends on it, only the logits


class TwoToolTurns:
    def reset(self, row):
        self.seen = 0
        return Reset(messages=row["prompt"])

    def step(self, episode):
        self.seen += 1
        return Step(done=True) if self.seen > 2 else Step(messages=[{"role": "tool", "content": f"result {self.seen}"}])


def play(mode):
    lora = LoraSettings(rank=4, alpha=8, target_modules=TARGET) if mode == "lora" else None
    model = PolicyModel(load_causal_lm(path, dtype=torch.float32, lora=lora))  # as the trainer builds it
    if groups.trains:
        sync = WeightSync(trainable_tensors(model), src=0)
        assert recv_object(1, groups.objects) == "decoding"
        torch.manual_seed(7)
        with torch.no_grad():  # version 1: the target weight changed (full), its adapters given values (lora)
            for name, p in model.named_parameters():
                if p.requires_grad and TARGET in name:
                    p.add_(torch.randn_like(p) * (0.5 if lora else 0.05))
        sync.push(1)
        episodes = recv_object(1, groups.objects)
        sync.push(STOP)
        weights = {n.rsplit(TARGET + ".", 1)[1]: p.detach().clone() for n, p in model.named_parameters() if TARGET in n}
        torch.save({"episodes": episodes, "weights": weights, "pushed": sync.names}, f"{out}/{mode}.pt")
        return
    engine = DecodeEngine(model, tok, device=torch.device("cpu"), dtype=torch.float64)  # decodes on a merged copy
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    runner = EpisodeRunner(engine, tok, AgentSettings(tokenization_sanity_check_mode="disable"),
                           environments=lambda row: TwoToolTurns())
    runner.template = Template(tok, {im_end})
    engine.eos_ids = {t for t in range(len(tok)) if t % 5 == 0} | {im_end}  # turns end within a few tokens
    inbox = WeightInbox(model, 512 << 20, 60)
    engine.between_steps = hold_until_push(inbox, groups, swap_at)  # the push lands mid-episode
    torch.manual_seed(0)
    rows = [{"uid": f"p{i}", "prompt": [{"role": "user", "content": q}]}
            for i, q in enumerate(["Add 2 and 3.", "What is 7 times 6?"])]
    episodes = runner.run(rows, 2, SamplingParams(n=2, max_new_tokens=48, logprobs=True))
    send_object([{"prompt_ids": e.prompt_ids, "tokens": e.tokens, "mask": e.mask, "logprobs": e.logprobs,
                  "versions": e.versions} for e in episodes], 0, groups.objects)
    inbox.thread.join(60)
    assert inbox.stopped and inbox.current == 1


for mode in ("full", "lora"):
    play(mode)
shutdown()
exit_process(0)
"""


def test_a_push_mid_episode_is_taken_between_decoding_steps_of_multi_turn_episodes_full_and_lora(tmp_path,
                                                                                                   tiny_model_dir):
    """Partial rollouts of multi-turn episodes (the episode loop), full weights and LoRA adapters: a push that
    lands mid-episode is swapped in before the episode loop's next forward, so one trajectory holds policy tokens
    sampled by version 0 then by version 1 (in a later turn too), each labelled version 0: the episode's keys from
    its prompt on were computed by version 0 and kept; tool tokens carry no version and no log-prob (masked); each
    policy token's recorded behaviour log-prob is what a plain float64 forward of the whole conversation gives with
    the weights that sampled it, the new ones from the swap on (the push changes the last layer's output
    projection, which no cached key or value depends on; under LoRA base + alpha/r x B A re-derived here); and under
    LoRA only the adapters travel."""
    import torch

    from posttrain.models.load import load_causal_lm

    # the 3rd forward: after two tokens of every first turn
    _run_two(EPISODES_SCRIPT, tmp_path, tiny_model_dir, 3, timeout=240)
    lm = load_causal_lm(str(tiny_model_dir), dtype=torch.float64)
    layer = lm.model.layers[1].mlp.down_proj
    base = layer.weight.detach().clone()

    def logprobs(weight, ids):
        with torch.no_grad():
            layer.weight.copy_(weight)
            return torch.log_softmax(lm(input_ids=torch.tensor([ids])).logits[0].double(), -1)

    for mode in ("full", "lora"):
        got = torch.load(tmp_path / f"{mode}.pt", weights_only=False)
        w = {k: v.double() for k, v in got["weights"].items()}
        new = base + 8 / 4 * w["lora_B.default.weight"] @ w["lora_A.default.weight"] if mode == "lora" else w["weight"]
        if mode == "lora":
            assert got["pushed"] and all(".lora_A." in n or ".lora_B." in n for n in got["pushed"]), got["pushed"]
        mixed = later_turn = 0
        for ep in got["episodes"]:
            policy = [i for i, m in enumerate(ep["mask"]) if m]
            # every policy token attended to the prompt's keys, computed by version 0: its label, whichever weights
            # sampled it
            assert {ep["versions"][i] for i in policy} == {0}, ep["versions"]
            assert all(ep["versions"][i] == 0 and ep["logprobs"][i] == 0 for i, m in enumerate(ep["mask"]) if not m)
            P, ids = len(ep["prompt_ids"]), ep["prompt_ids"] + ep["tokens"]
            old, pushed = logprobs(base, ids), logprobs(new, ids)
            by_new = []
            for i in policy:
                lp, at = ep["logprobs"][i], (P + i - 1, ep["tokens"][i])
                by_new.append(abs(lp - float(pushed[at])) < 1e-4 and abs(lp - float(old[at])) > 1e-4)
                assert by_new[-1] or abs(lp - float(old[at])) < 1e-4, (mode, i)
            swap = by_new.index(True) if True in by_new else len(by_new)
            assert all(abs(ep["logprobs"][i] - float(pushed[P + i - 1, ep["tokens"][i]])) < 1e-4
                       for i in policy[swap:]), mode  # the new weights sampled every token after their first
            mixed += 0 < swap < len(by_new)
            later_turn += any(n and 0 in ep["mask"][:i] for i, n in zip(policy, by_new))
        assert mixed and later_turn, (mode, mixed, later_turn)


def test_refreshing_a_merged_decoding_copy_after_an_adapter_push_equals_a_fresh_copy(tiny_model_dir):
    """Under LoRA (every linear layer) decoding runs on a bfloat16 copy with the adapters merged; after new adapter
    values arrive, `refresh_copy` makes that copy equal, bit for bit, to a copy made afresh from the updated model,
    and a tensor the copy cannot hold is refused by name."""
    import torch

    from posttrain.models.load import LoraSettings, load_causal_lm
    from posttrain.models.policy import PolicyModel
    from posttrain.parallel.weight_sync import trainable_tensors
    from posttrain.rollout.weights import inference_weights, refresh_copy

    model = PolicyModel(load_causal_lm(str(tiny_model_dir), dtype=torch.float32, lora=LoraSettings(rank=4, alpha=8)))
    pushed = trainable_tensors(model)
    with inference_weights(model, torch.bfloat16) as decoding:
        before = {n: p.clone() for n, p in decoding.named_parameters()}
        torch.manual_seed(0)
        with torch.no_grad():
            for t in pushed.values():
                t.copy_(torch.randn_like(t))
        refresh_copy(decoding, model, list(pushed))
        refreshed = {n: p.clone() for n, p in decoding.named_parameters()}
        with pytest.raises(RuntimeError, match="no tensor lm.extra.weight"):
            refresh_copy(decoding, torch.nn.ModuleDict({"lm": torch.nn.ModuleDict({"extra": torch.nn.Linear(2, 2)})}),
                         ["lm.extra.weight"])
    with inference_weights(model, torch.bfloat16) as fresh:
        want = dict(fresh.named_parameters())
        assert refreshed.keys() == want.keys()
        changed = [n for n in want if not torch.equal(before[n], want[n])]
        assert len(changed) >= 7 * 2  # each adapted linear layer of both layers
        for name, t in want.items():
            assert torch.equal(refreshed[name], t), name
