"""What the run will read, checked when the config loads rather than minutes in: data files, the reward function's
file, model and tokenizer sources, tracking packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .schema import Config


def check_sources(cfg: Config, check) -> None:
    """Add a problem to `check` (validate.Checks) for each thing the run will read that is not there."""
    group = "files, models and packages"
    for key in ("train_files", "val_files"):
        value = getattr(cfg.data, key)
        for path in [value] if isinstance(value, str) else list(value or []):
            check(Path(str(path)).is_file(), f"data.{key}: '{path}' does not exist (or is not a file)", group)
    if cfg.data.environment and cfg.data.environment.startswith("verifiers:"):
        check(importlib.util.find_spec("verifiers") is not None, f"data.environment={cfg.data.environment} needs "
              "the verifiers package: pip install 'posttrain[verifiers]'", group)
    reward_file = cfg.custom_reward_function.path
    if reward_file:
        from .reward_file import reward_file_problem

        problem = reward_file_problem(reward_file, cfg.custom_reward_function.name)
        check(problem is None, problem or "", group)
    from ..models.hub import model_source_problem

    arr = cfg.actor_rollout_ref
    for key, path in (("actor_rollout_ref.model.path", arr.model.path),
                      ("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path),
                      ("critic.model.path", cfg.critic.model.path),
                      *((("reward_model.model.path", cfg.reward_model.model.path),
                         ("reward_model.model.input_tokenizer", cfg.reward_model.model.input_tokenizer))
                        if cfg.reward_model.enable else ())):
        if path:
            problem = model_source_problem(str(path), key=key)
            check(problem is None, problem or "", group)
    loggers = cfg.trainer.logger
    for name in [loggers] if isinstance(loggers, str) else loggers:
        if name in ("wandb", "mlflow", "tensorboard"):
            check(importlib.util.find_spec(name) is not None, f"trainer.logger names {name}, which is not "
                  f"installed: pip install {_LOGGER_PACKAGES[name]} (or remove it from trainer.logger)", group)


_LOGGER_PACKAGES = {"wandb": "'posttrain[tracking]'", "mlflow": "'posttrain[tracking]'", "tensorboard": "tensorboard"}
