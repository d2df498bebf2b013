"""Runs inside each process of a distributed test (torchrun), or alone as the one-process reference.

`python tests/dist_worker.py SPEC.json`: for each case of the spec, build the trainer's roles from the case's
overrides, run `RLTrainer.learn` on the fixed batch of the spec (old/ref log-probs, values, advantages, critic and
actor updates), and rank 0 saves the metrics, the full gradients and learning rate of every optimizer step, the
full updated weights and the shapes of its own parameter shards to OUT/<case>.pt. With `count_gathers` it also
records how many parameter all-gathers one generate call makes, for two response lengths. With
`fail_checks_on_rank` that rank's one-time fast-path checks fail, a generate call runs first, and every rank saves
what it decided to OUT/<case>_checks_rank<r>.json. A spec with `rows` runs `rows_of_each_rank` instead.
"""

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


class CountAllGathers(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).startswith("c10d.") and "allgather" in str(func):
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


def fail_checks_here() -> None:
    """This process's one-time fast-path checks find a difference, after running the same passes as elsewhere."""
    import posttrain.models.policy as policy
    import posttrain.rollout.engine as engine

    switch, compare = policy.switch_on_if_equal, engine.DecodeEngine._compare
    policy.switch_on_if_equal = lambda module, config, plain, shared, what: switch(
        module, config, plain, lambda *args: shared(*args) + 1.0, what)
    engine.DecodeEngine._compare = lambda self, model: compare(self, model) or "forced to differ in this process"


def rows_of_each_rank(spec: dict, out: Path) -> None:
    """Each rank's own rows (`spec["rows"]`: per rank ids, mask, uids) through the sharded policy, forward and
    backward, and its log-probs saved to OUT/rows_rank<r>.pt."""
    from posttrain.models.load import load_causal_lm
    from posttrain.models.policy import PolicyModel
    from posttrain.models.shared_prompt import prompt_groups
    from posttrain.parallel import ShardSettings, init_parallel, prepare_model

    par = init_parallel(device_name="cpu")
    model = prepare_model(lambda meta: PolicyModel(load_causal_lm(spec["model"], meta=meta)), par, ShardSettings())
    ids, mask, uids = torch.load(spec["rows"])[par.rank]
    logp, _ = model(ids, mask, spec["response_length"], prompts=prompt_groups(uids))
    logp.sum().backward()
    torch.save(logp.detach(), out / f"rows_rank{par.rank}.pt")
    shutdown()


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    if "rows" in spec:
        return rows_of_each_rank(spec, out)
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
        metrics = trainer.learn(batch)
        if "fail_checks_on_rank" in spec:
            parts = trainer.parts
            models = {"actor": parts.actor, "reference": parts.reference, "critic": parts.critic}
            checks = {role: obj.model.shared_prompt_ok for role, obj in models.items() if obj is not None}
            checks["rollout"] = parts.engine.shared_prefix_ok
            (out / f"{name}_checks_rank{par.rank}.json").write_text(json.dumps(checks))
        states = {role: full_model_state(obj.model) for role, obj in trainer.parts.trained.items()}  # a collective
        if par.is_main:
            shared = {role: getattr(obj.model, "shared_prompt_ok", None) for role, obj in trainer.parts.trained.items()}
            shards = {role: {name: tuple(p.to_local().shape) for name, p in obj.model.named_parameters()
                             if hasattr(p, "to_local")} for role, obj in trainer.parts.trained.items()}
            torch.save({"metrics": metrics, "states": states, "steps": steps, "shared": shared,
                        "local_shapes": shards,
                        "old_log_probs": batch.get("old_log_probs"),
                        "ref_log_probs": batch.get("ref_log_probs"), "values": batch.get("values")},
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
