"""The teachers of on-policy distillation (`distillation.*`) as the run loads them, and the checks of those keys
when the config loads."""

from __future__ import annotations

from dataclasses import dataclass

from .schema import Config

KEY = "distillation.teacher_models"
ENTRY_KEYS = ("model_path", "key", "num_replicas", "inference")  # the last two: accepted, no effect here
SINGLE = "teacher_model"  # the conventional name of the only teacher


@dataclass(frozen=True)
class Teacher:
    name: str  # its entry under teacher_models
    key: str | None  # the value of the row field `teacher_key` it scores; None: every row
    model_path: str


def _entries(cfg: Config) -> dict:
    """The teacher entries; beside others, a `teacher_model` entry without a model_path is the key tree's empty
    default (a dumped config holds it) and is left out."""
    entries = {name: entry or {} for name, entry in cfg.distillation.teacher_models.items()}
    if len(entries) > 1 and isinstance(entries.get(SINGLE), dict) and not entries[SINGLE].get("model_path"):
        del entries[SINGLE]
    return entries


def teachers(cfg: Config) -> list[Teacher]:
    """The configured teachers (none when distillation is off). One entry scores every row; several each score
    the rows whose `teacher_key` field equals their `key`. Assumes `check_distillation` passed."""
    d = cfg.distillation
    if not d.enabled:
        return []
    entries = _entries(cfg)
    if len(entries) == 1:
        (name, entry), = entries.items()
        return [Teacher(name, None, str(entry["model_path"]))]
    return [Teacher(name, str(entry["key"]), str(entry["model_path"])) for name, entry in entries.items()]


def check_distillation(cfg: Config, check) -> None:
    """Add each problem to `check` (validate.Checks)."""
    d = cfg.distillation
    if not d.enabled:
        return
    loss = d.distillation_loss
    try:
        settings(cfg).check()
    except ValueError as e:
        check(False, str(e), "wrong values")
    check(loss.policy_loss_mode == "vanilla", f"distillation.distillation_loss.policy_loss_mode="
          f"{loss.policy_loss_mode!r}: only `vanilla` (the PPO clipped loss) applies the distillation reward",
          "not supported by posttrain")
    entries = _entries(cfg)
    if not check(bool(entries), f"distillation.enabled=True needs a teacher: set {KEY}.{SINGLE}.model_path"):
        return
    for name, entry in entries.items():
        entry = entry or {}
        if not check(isinstance(entry, dict), f"{KEY}.{name} must be a mapping of model_path, key", "wrong values"):
            continue
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        check(not unknown, f"{KEY}.{name}: unknown keys {unknown}; a teacher takes {list(ENTRY_KEYS)}",
              "unknown keys")
        check(bool(entry.get("model_path")), f"{KEY}.{name}.model_path is required (the teacher's Hugging Face "
                                             "model: a local directory or a hub id)")
    if len(entries) > 1:
        check(SINGLE not in entries, f"{KEY}.{SINGLE} beside other teachers: rename it (e.g. teacher_model1) and "
                                     f"give each teacher a `key` (the {KEY} entry of that name would otherwise be "
                                     "dropped, as in the key tree this one ports from)")
        keys = [str(e["key"]) for e in entries.values() if isinstance(e, dict) and e.get("key") is not None]
        check(all((e or {}).get("key") is not None for e in entries.values() if isinstance(e, dict)),
              f"several teachers: each {KEY}.<name>.key must name the value of the row field "
              f"distillation.teacher_key={d.teacher_key!r} it scores")
        check(len(set(keys)) == len(keys), f"{KEY}: two teachers have the same key {sorted(keys)}")


def settings(cfg: Config):
    """The loss's settings (algo.distill.DistillSettings) from `distillation.distillation_loss`."""
    from ..algo.distill import DistillSettings

    x = cfg.distillation.distillation_loss
    return DistillSettings(loss_mode=x.loss_mode, topk=x.topk, use_task_rewards=x.use_task_rewards,
                           distillation_loss_coef=x.distillation_loss_coef, loss_max_clamp=x.loss_max_clamp,
                           log_prob_min_clamp=x.log_prob_min_clamp, use_policy_gradient=x.use_policy_gradient,
                           clip_ratio_low=x.clip_ratio_low, clip_ratio_high=x.clip_ratio_high)
