"""Runs inside each process of a distributed test (torchrun), or alone as the one-process reference.

`python tests/dist_worker.py SPEC.json`: for each case of the spec, build the trainer's roles from the case's
overrides, run `RLTrainer.learn` on the fixed batch of the spec (old/ref log-probs, values, advantages, critic and
actor updates), and rank 0 saves the metrics, the full gradients and learning rate of every optimizer step, the
full updated weights, the shapes of its own parameter shards and how many all-to-alls it ran (sequence
parallel's head exchanges) to OUT/<case>.pt. With `count_gathers` it also
records how many parameter all-gathers one generate call makes, for two response lengths. With
`fail_checks_on_rank` that rank's one-time fast-path checks fail, a generate call runs first, and every rank saves
what it decided to OUT/<case>_checks_rank<r>.json. A spec with `rows` runs `rows_of_each_rank` instead; a spec with
`steps` runs whole multi-turn steps (`multi_turn_steps`): rollouts on each rank, gathered, then learn and validate;
with `slow_rank` that rank's environments answer the first prompt's episodes late; `steps: "single"` runs whole
single-turn steps (`single_turn_steps`); `tp_episodes` runs multi-turn episodes on a tensor-parallel pair whose
environments answer differently in each process (`tp_episodes`).
"""

import faulthandler
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posttrain.config import load_config
from posttrain.parallel.context import exit_process, shutdown
from posttrain.rollout.base import SamplingParams
from posttrain.trainer.rl import RLTrainer
from posttrain.trainer.setup import parallel_for

faulthandler.enable()  # a rank that crashes in native code (a segfault in a collective) prints its Python stack


class CountAllGathers(TorchDispatchMode):
    def __init__(self, collective: str = "allgather"):
        super().__init__()
        self.count, self.collective = 0, collective

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d.") and self.collective in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))



def full_model_state(model) -> dict:
    """The whole model's weights as plain CPU tensors, gathered from the shards (a collective when sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

def record_gradients(role) -> list[dict]:
    """What each optimizer step of `role` applies: {"lr": its learning rate, "grads": the full gradients after
    clipping}, one dict per step; a collective when the model is sharded (every rank steps together)."""
    names = {id(p): name for name, p in role.model.named_parameters()}
    steps = []

    def before_step(optimizer, args, kwargs):
        grads = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads[names[id(p)]] = g.detach().float().cpu().clone()
        steps.append({"lr": optimizer.param_groups[0]["lr"], "grads": grads})

    role.optimizer.register_step_pre_hook(before_step)
    return steps


def offset_model_checks(difference: float) -> None:
    """This process's one-time model checks (packed and shared-prompt paths) see their fast path `difference` off
    the plain one, after running the same passes as elsewhere."""
    import posttrain.models.policy as policy

    switch = policy.switch_on_if_equal
    policy.switch_on_if_equal = lambda module, config, plain, shared, what, **kw: switch(
        module, config, plain, lambda *args: shared(*args) + difference, what, **kw)


def fail_checks_here() -> None:
    """This process's one-time fast-path checks find a difference, after running the same passes as elsewhere."""
    import posttrain.rollout.engine as engine

    offset_model_checks(1.0)
    compare = engine.DecodeEngine._compare
    engine.DecodeEngine._compare = lambda self, model: compare(self, model) or "forced to differ in this process"


def rows_of_each_rank(spec: dict, out: Path) -> None:
    """Each rank's own rows (`spec["rows"]`: per rank ids, mask, uids) through the sharded policy, forward and
    backward, and its log-probs saved to OUT/rows_rank<r>.pt. With `mixed_precision` the shards compute in bf16
    (FSDP's MixedPrecisionPolicy); with `packed` the rows run padding-free; with `check_difference` the one-time
    fast-path checks see their fast path differ from the plain one by that much. What the checks decided goes to
    OUT/rows_checks_rank<r>.json."""
    from posttrain.models.load import load_causal_lm
    from posttrain.models.policy import PolicyModel
    from posttrain.models.shared_prompt import prompt_groups
    from posttrain.parallel import ShardSettings, init_parallel, prepare_model

    if spec.get("check_difference"):
        offset_model_checks(spec["check_difference"])
    par = init_parallel(device_name="cpu")
    settings = ShardSettings(param_dtype=torch.bfloat16 if spec.get("mixed_precision") else None)
    model = prepare_model(lambda meta: PolicyModel(load_causal_lm(spec["model"], meta=meta)), par, settings)
    ids, mask, uids = torch.load(spec["rows"])[par.rank]
    logp, _ = model(ids, mask, spec["response_length"], prompts=prompt_groups(uids), packed=spec.get("packed", False))
    logp.sum().backward()
    torch.save(logp.detach(), out / f"rows_rank{par.rank}.pt")
    (out / f"rows_checks_rank{par.rank}.json").write_text(json.dumps({"shared": model.shared_prompt_ok,
                                                                       "packed": model.packed_ok}))
    shutdown()


def tp_episodes(spec: dict, out: Path) -> None:
    """Multi-turn episodes on a tensor-parallel pair (2 processes, tp=2), greedy, with an environment whose answer
    differs between processes (it names its process, with a length that differs too) and counts a tool call on the
    episode: each process saves its episodes' prompts, tokens, masks, messages and tool counts to
    OUT/tp_episodes_rank<r>.json."""
    import os

    from posttrain.agents.environment import Reset, Step
    from posttrain.agents.loop import EpisodeRunner
    from posttrain.agents.settings import AgentSettings
    from posttrain.models.load import load_causal_lm, load_tokenizer
    from posttrain.models.policy import PolicyModel
    from posttrain.parallel import ShardSettings, init_parallel, prepare_model
    from posttrain.rollout.engine import DecodeEngine

    class Differs:
        def reset(self, row):
            self.seen = 0
            return Reset(messages=[{"role": "user", "content": f"Count to {row['uid']}."}])

        def step(self, episode):
            self.seen += 1
            episode.tool_calls += 1
            if self.seen > 2:
                return Step(done=True)
            me = int(os.environ["RANK"])
            return Step(messages=[{"role": "tool", "content": f"process {me} " + "x" * (1 + 7 * me)}], reward=me)

        def close(self):
            pass

    par = init_parallel(device_name="cpu", tp=2)
    tok = load_tokenizer(spec["model"])
    model = prepare_model(lambda meta: PolicyModel(load_causal_lm(spec["model"], meta=meta)), par,
                          ShardSettings(param_dtype=torch.float32))
    engine = DecodeEngine(model, tok, device=par.device, dtype=torch.float32)
    runner = EpisodeRunner(engine, tok, AgentSettings(tokenization_sanity_check_mode="disable"),
                           environments=lambda row: Differs())
    short_turns(runner)
    episodes = runner.run([{"uid": "p0"}, {"uid": "p1"}], 2, SamplingParams(n=2, do_sample=False, max_new_tokens=60))
    (out / f"tp_episodes_rank{par.rank}.json").write_text(json.dumps([
        {"prompt": e.prompt_ids, "tokens": e.tokens, "mask": e.mask, "messages": e.messages, "reward": e.env_reward,
         "tool_calls": e.tool_calls, "turns": e.assistant_turns} for e in episodes]))
    shutdown()


def short_turns(runner) -> None:
    """The tiny model's turns end within a few tokens: every fifth token id ends a turn (its random weights rarely
    sample the template's own end token), as in tests/test_agents_loop.py."""
    from posttrain.agents.template import Template

    tok = runner.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    runner.template = Template(tok, {im_end})
    runner.engine.eos_ids = {t for t in range(len(tok)) if t % 5 == 0} | {im_end}


def check_rows_are_their_episodes(batch) -> None:
    """Each row of a multi-turn batch holds its own episode (meta `episode`): its prompt, its tokens right-padded,
    `response_mask` its policy mask, `response_attention_mask` and `attention_mask` 1 on its real tokens only."""
    episodes = batch.meta["episode"]
    assert len(episodes) == len(batch), (len(episodes), len(batch))
    P, L = batch["prompts"].shape[1], batch["responses"].shape[1]
    for i, ep in enumerate(episodes):
        n, p = len(ep.tokens), len(ep.prompt_ids)
        assert batch["prompts"][i, P - p:].tolist() == ep.prompt_ids, i
        assert batch["prompt_mask"][i].tolist() == [0] * (P - p) + [1] * p, i
        assert batch["responses"][i, :n].tolist() == ep.tokens, i
        assert batch["response_mask"][i].tolist() == ep.mask + [0] * (L - n), i
        assert batch["response_attention_mask"][i].tolist() == [1] * n + [0] * (L - n), i
        assert batch["attention_mask"][i].tolist() == [0] * (P - p) + [1] * (p + n) + [0] * (L - n), i
        assert batch.meta["uid"][i].rsplit("-", 1)[1] == str(ep.row["uid"]).rsplit("-", 1)[1], i


def slow_first_prompt(runner) -> None:
    """In this process, the environment of each batch's first prompt answers 0.3 s late."""
    import time

    make = runner.environments

    def slowed(row):
        env = make(row)
        step = env.step

        def late(episode):
            if str(row.get("uid", "")).endswith("-0"):
                time.sleep(0.3)
            return step(episode)

        env.step = late
        return env

    runner.environments = slowed


def keep_learned_batches(trainer, check=None) -> list:
    """The batches `trainer.learn` is called with from now on, in order (each passed to `check` first); its
    arguments are passed on unchanged."""
    batches, learn = [], trainer.learn

    def learning(batch, *args, **kwargs):
        if check is not None:
            check(batch)
        batches.append(batch)
        return learn(batch, *args, **kwargs)

    trainer.learn = learning
    return batches


def multi_turn_steps(spec: dict, out: Path) -> None:
    """For each case: one training step on multi-turn episodes of the built-in guess_number environment (each rank
    runs the episodes of its own prompts; the scored batches are gathered), then validation. Every rank checks that
    each row of the step's batch is its episode and saves the uids of the prompts it ran episodes for; rank 0 saves
    the batch, the metrics, the gradients and the updated weights to OUT/<case>.pt."""
    par = None
    for name, overrides in spec["cases"].items():
        cfg = load_config(None, spec["base"] + overrides)
        par = par or parallel_for(cfg)
        trainer = RLTrainer(cfg, par)
        runner = trainer.parts.episodes
        short_turns(runner)
        ran, run = [], runner.run

        def recording(rows, n, sampling, **kwargs):
            ran.append({"uids": [r["uid"] for r in rows], "greedy": sampling.greedy})
            return run(rows, n, sampling, **kwargs)

        runner.run = recording
        if spec.get("slow_rank") == par.rank:
            slow_first_prompt(runner)
        batches = keep_learned_batches(trainer, check_rows_are_their_episodes)
        steps = {role: record_gradients(obj) for role, obj in trainer.parts.trained.items()}
        trainer.global_step = 1  # as fit() counts it
        metrics = trainer.train_step()
        val = trainer.validate()
        (out / f"{name}_ran_rank{par.rank}.json").write_text(json.dumps(ran))
        torch.save(batches[0]["input_ids"], out / f"{name}_input_ids_rank{par.rank}.pt")
        states = {role: full_model_state(obj.model) for role, obj in trainer.parts.trained.items()}
        if par.is_main:
            batch = batches[0]
            torch.save({"metrics": metrics, "val": val, "states": states, "steps": steps,
                        "tensors": {k: v for k, v in batch.tensors.items()},
                        "uid": batch.meta["uid"], "turns": [e.assistant_turns for e in batch.meta["episode"]]},
                       out / f"{name}.pt")
        trainer.parts.reward.close()
    shutdown()


def single_turn_steps(spec: dict, out: Path) -> None:
    """For each case: one whole training step (generate, score, gather, learn). Every rank saves the prompts it
    generated from (their uids, samples each) to OUT/<case>_generated_rank<r>.json; rank 0 saves the batch, the
    metrics, the gradients and the updated weights to OUT/<case>.pt."""
    par = None
    for name, overrides in spec["cases"].items():
        cfg = load_config(None, spec["base"] + overrides)
        par = par or parallel_for(cfg)
        trainer = RLTrainer(cfg, par)
        generated, generate = [], trainer.parts.engine.generate

        def recording(batch, sampling):
            generated.append({"uids": list(batch.meta["uid"]), "n": sampling.n, "greedy": not sampling.do_sample})
            return generate(batch, sampling)

        trainer.parts.engine.generate = recording
        batches = keep_learned_batches(trainer)
        steps = {role: record_gradients(obj) for role, obj in trainer.parts.trained.items()}
        trainer.global_step = 1  # as fit() counts it
        metrics = trainer.train_step()
        (out / f"{name}_generated_rank{par.rank}.json").write_text(json.dumps(generated))
        states = {role: full_model_state(obj.model) for role, obj in trainer.parts.trained.items()}
        if par.is_main:
            batch = batches[0]
            torch.save({"metrics": metrics, "states": states, "steps": steps, "uid": batch.meta["uid"],
                        "tensors": {k: v for k, v in batch.tensors.items()}}, out / f"{name}.pt")
        trainer.parts.reward.close()
    shutdown()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    if "rows" in spec:
        return rows_of_each_rank(spec, out)
    if spec.get("tp_episodes"):
        return tp_episodes(spec, out)
    if spec.get("steps") == "single":
        return single_turn_steps(spec, out)
    if spec.get("steps"):
        return multi_turn_steps(spec, out)
    par = None
    for name, overrides in spec["cases"].items():
        cfg = load_config(None, spec["base"] + overrides)
        par = par or parallel_for(cfg)
        if spec.get("fail_checks_on_rank") == par.rank:
            fail_checks_here()
        trainer = RLTrainer(cfg, par)
        trainer.global_step = 1
        batch = torch.load(spec["batch"], weights_only=False)
        if "fail_checks_on_rank" in spec:  # as a step runs: generate, then learn; each rank's decisions saved
            with trainer.parts.actor.generation():
                trainer.parts.engine.generate(batch.select(range(par.dp_rank, len(batch), 8)),
                                              SamplingParams(n=2, max_new_tokens=3))
        steps = {role: record_gradients(obj) for role, obj in trainer.parts.trained.items()}
        with CountAllGathers("alltoall") as all_to_all:
            metrics = trainer.learn(batch)
        if "fail_checks_on_rank" in spec:
            parts = trainer.parts
            models = {"actor": parts.actor, "reference": parts.reference, "critic": parts.critic}
            checks = {role: obj.model.shared_prompt_ok for role, obj in models.items() if obj is not None}
            checks |= {f"{role}_packed": obj.model.packed_ok for role, obj in models.items() if obj is not None}
            checks["rollout"] = parts.engine.shared_prefix_ok
            (out / f"{name}_checks_rank{par.rank}.json").write_text(json.dumps(checks))
        states = {role: full_model_state(obj.model) for role, obj in trainer.parts.trained.items()}  # a collective
        if par.is_main:
            shared = {role: getattr(obj.model, "shared_prompt_ok", None) for role, obj in trainer.parts.trained.items()}
            shared |= {f"{role}_packed": getattr(obj.model, "packed_ok", None)
                       for role, obj in trainer.parts.trained.items()}
            shards = {role: {name: tuple(p.to_local().shape) for name, p in obj.model.named_parameters()
                             if hasattr(p, "to_local")} for role, obj in trainer.parts.trained.items()}
            torch.save({"metrics": metrics, "states": states, "steps": steps, "shared": shared,
                        "local_shapes": shards, "all_to_all": all_to_all.count,
                        "old_log_probs": batch.get("old_log_probs"),
                        "ref_log_probs": batch.get("ref_log_probs"), "values": batch.get("values"),
                        **{k: batch.get(k) for k in ("teacher_log_probs", "teacher_topk_log_probs",
                                                     "teacher_topk_ids")}},
                       out / f"{name}.pt")
        if spec.get("count_gathers") and name == next(iter(spec["cases"])):
            counts = []
            for max_new in (2, 6):
                prompts = batch.select(range(par.dp_rank, len(batch), 8))
                with CountAllGathers() as counter, trainer.parts.actor.generation():
                    trainer.parts.engine.generate(prompts, SamplingParams(n=1, max_new_tokens=max_new))
                counts.append(counter.count)
            units = sum(1 for m in trainer.parts.actor.model.modules() if type(m).__name__.startswith("FSDP"))
            if par.is_main:
                (out / "gathers.json").write_text(json.dumps({"counts": counts, "units": units}))
        trainer.parts.reward.close()
    shutdown()  # leave together (barrier, destroy the process group), as `posttrain` itself does


if __name__ == "__main__":
    main(sys.argv[1])
    exit_process(0)  # as `posttrain` ends: no interpreter teardown racing gloo's worker threads
