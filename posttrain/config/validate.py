"""Reject configs that cannot run, before any model is touched, with the reason and the fix.

`config_problems` reads a config (normalised first: normalise.py) and returns every problem it finds; it changes
nothing. The loader adds them to the problems of loading and reports all of them in one ConfigError.
"""

from __future__ import annotations

from pathlib import Path

from .loader import Problems
from .distillation import check_distillation
from .multi_turn import check_multi_turn
from .notes import LONE_GROUPS
from .normalise import normalise
from .router_replay import check_router_replay
from .user_code import check_user_code
from .rollout_engine import check_rollout_engine
from .schema import Config
from ..watch import settings_problems as watch_problems
from .sources import check_sources

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
STRATEGIES = ("fsdp", "fsdp2", "megatron")  # megatron: its layout maps onto FSDP2 x tensor parallel (a note says how)
DTYPES = ("auto", "bf16", "bfloat16", "fp16", "float16", "fp32", "float32")

FIT = "settings that do not fit together"


class Checks(Problems):
    """The problems found so far: a check that fails adds its message (to `group`) and returns False."""

    def __call__(self, cond: bool, message: str, group: str = FIT) -> bool:
        if not cond:
            self.add(group, message)
        return cond

    def choice(self, value, choices, key: str) -> bool:
        return self(value in choices, f"{key}={value!r} is not one of {list(choices)}", "wrong values")

    def unsupported(self, cond: bool, message: str) -> bool:
        return self(cond, message, "not supported by posttrain")


def config_problems(cfg: Config) -> Problems:
    """Every problem of a normalised config, grouped; the config is only read."""
    check = Checks()
    _validate(cfg, check)
    check_sources(cfg, check)
    return check


def validate_config(cfg: Config) -> Config:
    """For a config built in code: normalise it, then raise one ConfigError naming every problem."""
    config_problems(normalise(cfg)).raise_if_any()
    return cfg


def _validate(cfg: Config, check: Checks) -> None:
    from ..algo import LOSS_AGG_MODES, estimator_info, get_policy_loss, is_kl_estimator

    d, arr, alg, tr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    actor, rollout, model = arr.actor, arr.rollout, arr.model

    # ---- algorithm
    try:
        info = estimator_info(alg.adv_estimator)
    except KeyError as e:
        info = None
        check(False, f"algorithm.adv_estimator: {e.args[0]}", "wrong values")
    if info and info.uses_groups and not (alg.adv_estimator in LONE_GROUPS and rollout.n == 1):  # a note says
        check(rollout.n >= max(2, info.min_group_size),                                            # what n=1 is
              f"algorithm.adv_estimator={alg.adv_estimator} compares the responses to one prompt, so it needs "
              f"actor_rollout_ref.rollout.n >= 2 (got {rollout.n})")
    if info and info.needs_critic:
        check(cfg.critic.enable is not False,
              f"algorithm.adv_estimator={alg.adv_estimator} needs a critic, but critic.enable=False; "
              "enable the critic or pick a critic-free estimator such as grpo")
    for key, mode in (("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode),
                      ("critic.loss_agg_mode", cfg.critic.loss_agg_mode or actor.loss_agg_mode)):
        check.choice(mode, LOSS_AGG_MODES, key)
    try:
        get_policy_loss(actor.policy_loss.loss_mode)
    except KeyError as e:
        check(False, f"actor_rollout_ref.actor.policy_loss.loss_mode: {e.args[0]}", "wrong values")
    for key, kind in (("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type), ("algorithm.kl_penalty", alg.kl_penalty)):
        check(is_kl_estimator(kind), f"{key}={kind!r} is not a KL estimator (kl, k1, abs, mse, k2, low_var_kl, k3, "
                                     "each optionally with a '+' suffix)")
    check.choice(alg.kl_ctrl.type, ("fixed", "adaptive"), "algorithm.kl_ctrl.type")
    if alg.kl_ctrl.type == "adaptive":
        check(alg.kl_ctrl.target_kl > 0 and alg.kl_ctrl.horizon > 0,
              "algorithm.kl_ctrl adaptive needs target_kl > 0 and horizon > 0")
    check(0 <= alg.gamma <= 1 and 0 <= alg.lam <= 1, "algorithm.gamma and algorithm.lam must lie in [0, 1]")
    if info and info.needs_reward_components:
        keys = alg.gdpo_reward_keys
        check(isinstance(keys, list) and len(keys) > 0 and all(isinstance(k, str) for k in keys),
              f"algorithm.adv_estimator={alg.adv_estimator} normalises each reward component on its own: set "
              "algorithm.gdpo_reward_keys to the keys your compute_score returns, e.g. [accuracy_reward,format_reward]")
        w = alg.gdpo_reward_weights
        check(w is None or (isinstance(w, list) and len(w) == len(keys)),
              "algorithm.gdpo_reward_weights needs one weight per entry of algorithm.gdpo_reward_keys (or null)")
    _check_policy_loss(actor, check)
    _check_rollout_correction(alg.rollout_correction, check)
    check_router_replay(cfg, check)
    if alg.filter_groups.enable:
        check.choice(alg.filter_groups.metric, ("acc", "score", "seq_reward", "seq_final_reward"),
                     "algorithm.filter_groups.metric")
        check(rollout.n >= 2, "algorithm.filter_groups drops groups with equal scores; it needs rollout.n >= 2")

    # ---- actor
    check(actor.clip_ratio_c > 1,
          f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual-clip bound), got {actor.clip_ratio_c}")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, key)
        check(value is None or value >= 0, f"actor_rollout_ref.actor.{key} must be >= 0")
    check(d.train_batch_size > 0, "data.train_batch_size must be positive")
    check(0 < actor.ppo_mini_batch_size, "actor_rollout_ref.actor.ppo_mini_batch_size must be positive")
    check(actor.ppo_mini_batch_size <= 0 or d.train_batch_size % actor.ppo_mini_batch_size == 0,
          f"data.train_batch_size ({d.train_batch_size}) must be divisible by "
          f"actor_rollout_ref.actor.ppo_mini_batch_size ({actor.ppo_mini_batch_size}); both count prompts")
    for key, value in (("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
                       ("critic.ppo_micro_batch_size_per_gpu", cfg.critic.ppo_micro_batch_size_per_gpu)):
        check(value is None or value > 0, f"{key} must be positive")
    check(actor.ppo_epochs >= 1, "actor_rollout_ref.actor.ppo_epochs must be >= 1")
    for key, clip in (("actor_rollout_ref.actor.grad_clip", actor.grad_clip), ("critic.grad_clip", cfg.critic.grad_clip)):
        check(clip > 0, f"{key}={clip} must be positive (the largest gradient norm kept)")
    check(actor.loss_scale_factor is None or actor.loss_scale_factor > 0,
          "actor_rollout_ref.actor.loss_scale_factor must be positive (or null for data.max_response_length)")
    for key, strategy in (("actor_rollout_ref.actor.strategy", actor.strategy), ("critic.strategy", cfg.critic.strategy)):
        check.choice(strategy, STRATEGIES, key)
    _check_layout(cfg, check)
    check_distillation(cfg, check)
    _check_async(cfg, check)
    for optim_key, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", cfg.critic.optim)):
        check.choice(optim.warmup_style or optim.lr_scheduler_type, ("constant", "cosine"),
                     f"{optim_key}.lr_scheduler_type")
        check(optim.lr >= 0, f"{optim_key}.lr must be >= 0")
        check(len(optim.betas) == 2, f"{optim_key}.betas must hold two numbers")

    # ---- model
    check.choice(model.dtype, DTYPES, "actor_rollout_ref.model.dtype")
    check.choice(rollout.dtype, DTYPES, "actor_rollout_ref.rollout.dtype")
    check(model.lora_rank >= 0, "actor_rollout_ref.model.lora_rank must be >= 0 (0 = train all weights)")
    if model.lora_rank > 0:
        check(model.lora_alpha > 0, "actor_rollout_ref.model.lora_alpha must be positive")
        check(isinstance(model.target_modules, (str, list)) and bool(model.target_modules),
              "actor_rollout_ref.model.target_modules must be 'all-linear', a comma-separated string or a list "
              "of module names")
        excluded = model.exclude_modules
        check(excluded is None or isinstance(excluded, str) or
              (isinstance(excluded, list) and all(isinstance(m, str) for m in excluded)),
              "actor_rollout_ref.model.exclude_modules must be a regular expression or a list of module names")
    if model.lora_adapter_path:
        adapter = Path(str(model.lora_adapter_path)).expanduser() / "adapter_config.json"
        check(adapter.is_file(), f"actor_rollout_ref.model.lora_adapter_path: '{adapter}' does not exist (a saved "
                                 "LoRA adapter is a peft folder with adapter_config.json)", "files, models and packages")
    check.unsupported(arr.hybrid_engine or cfg.rollout.n_gpus_per_node > 0, "actor_rollout_ref.hybrid_engine=False: "
                      "posttrain shares weights between actor and rollout unless rollout.n_gpus_per_node > 0 "
                      "(asynchronous RL, where the generating process holds its own); remove the key")

    ctok = cfg.critic.model.tokenizer_path
    check(ctok is None or ctok in (model.tokenizer_path, model.path),
          "critic.model.tokenizer_path differs from the actor's tokenizer; the critic reads the actor's token ids, "
          "so it must use the same tokenizer (remove the key)")

    # ---- rollout
    check_rollout_engine(cfg, check)
    check(rollout.n >= 1, "actor_rollout_ref.rollout.n must be >= 1")
    check(rollout.prompt_length in (None, d.max_prompt_length),
          "actor_rollout_ref.rollout.prompt_length differs from data.max_prompt_length; prompts are cut by "
          "data.max_prompt_length, set that instead")
    check(rollout.response_length in (None, d.max_response_length),
          f"actor_rollout_ref.rollout.response_length={rollout.response_length} differs from "
          f"data.max_response_length={d.max_response_length}; one length bounds generation, the overlong "
          "penalty's window and the seq-mean-token-sum-norm constant: set data.max_response_length (the rollout "
          "follows it, as in verl)")
    check(rollout.temperature >= 0, "actor_rollout_ref.rollout.temperature must be >= 0")
    check(0 < rollout.top_p <= 1, "actor_rollout_ref.rollout.top_p must lie in (0, 1]")
    check(rollout.val_kwargs.n >= 1, "actor_rollout_ref.rollout.val_kwargs.n must be >= 1")
    check.choice(rollout.mode, ("async", "sync"), "actor_rollout_ref.rollout.mode")
    check_multi_turn(cfg, check)
    check_user_code(cfg, check)

    # ---- data
    check.choice(d.truncation, ("error", "left", "right", "middle"), "data.truncation")
    check(d.max_prompt_length > 0 and d.max_response_length > 0,
          "data.max_prompt_length and max_response_length must be positive")
    check(d.val_batch_size is None or d.val_batch_size > 0, f"data.val_batch_size={d.val_batch_size} must be positive "
                                                            "(or null: all validation prompts at once)")
    for key in ("train_max_samples", "val_max_samples"):
        value = getattr(d, key)
        check(value == -1 or value >= 1, f"data.{key}={value} must be >= 1 (or -1: every row)")
    if d.environment is not None:
        _check_environment(cfg, check)

    # ---- reward
    rm = cfg.reward_model
    if rm.enable:
        check(bool(rm.model.path), "reward_model.enable=True needs reward_model.model.path (a sequence classifier "
                                   "with one label, e.g. Skywork/Skywork-Reward-V2-Llama-3.1-8B, or a causal LM "
                                   "with reward_model.judge.enable=True)")
        check(rm.micro_batch_size_per_gpu is None or rm.micro_batch_size_per_gpu > 0,
              "reward_model.micro_batch_size_per_gpu must be positive (or null: one pass over the rank's rows)")
        check(rm.max_length is None or rm.max_length > 0, "reward_model.max_length must be positive (or null)")
        check(rm.forward_max_token_len_per_gpu > 0, "reward_model.forward_max_token_len_per_gpu must be positive")
    if rm.judge.enable:
        _check_judge(rm, check)
    check.choice(rm.reward_manager, ("naive", "batch", "prime", "dapo", "gdpo"), "reward_model.reward_manager")
    check(rm.num_workers is None or rm.num_workers >= 0,
          "reward_model.num_workers must be >= 0 (0 = score in the training process; null = from the CPU cores)")
    check(rm.reward_manager != "prime" or rm.num_workers != 0,
          "reward_model.reward_manager=prime scores in worker processes: set reward_model.num_workers >= 1 or null "
          "(or use reward_manager=naive to score in the training process)")
    check(rm.timeout_s > 0, "reward_model.timeout_s must be positive (seconds per response)")
    check(0 <= rm.max_error_rate <= 1, "reward_model.max_error_rate must lie in [0, 1] (1 never stops the run)")
    check.unsupported(not rm.launch_reward_fn_async, "reward_model.launch_reward_fn_async=True is not supported; "
                                                     "scoring runs in worker processes already "
                                                     "(reward_model.num_workers)")
    if rm.sandbox_fusion.url is not None:
        check(str(rm.sandbox_fusion.url).startswith(("http://", "https://")),
              "reward_model.sandbox_fusion.url must be an http(s) address, e.g. http://host:8080/run_code")
    check(rm.sandbox_fusion.max_concurrent > 0, "reward_model.sandbox_fusion.max_concurrent must be positive")
    check(rm.sandbox_fusion.memory_limit_mb > 0, "reward_model.sandbox_fusion.memory_limit_mb must be positive")
    check(rm.code_sandbox.run_timeout > 0, "reward_model.code_sandbox.run_timeout must be positive (seconds)")
    if rm.overlong_buffer.enable:
        check(0 < rm.overlong_buffer.len <= d.max_response_length,
              "reward_model.overlong_buffer.len must lie in (0, data.max_response_length]")

    # ---- trainer
    for name in [tr.logger] if isinstance(tr.logger, str) else tr.logger:
        check.choice(name, LOGGERS, "trainer.logger entry")
    check.choice(tr.resume_mode, ("auto", "disable", "resume_path"), "trainer.resume_mode")
    for problem in watch_problems(tr.watch):
        check(False, problem, "wrong values")
    if tr.resume_mode == "resume_path":
        check(bool(tr.resume_from_path), "trainer.resume_mode=resume_path needs trainer.resume_from_path")
    check(not tr.overwrite_run_dir or tr.resume_mode == "disable",
          "trainer.overwrite_run_dir=True starts over, so it goes with trainer.resume_mode=disable (with "
          f"resume_mode={tr.resume_mode} the run would resume instead)")
    check.choice(tr.device, ("auto", "cpu", "cuda"), "trainer.device")
    check(not tr.val_only or bool(d.val_files) or bool(d.environment) and d.val_max_samples > 0,
          "trainer.val_only=True validates and stops, so it needs data.val_files (or data.environment with "
          "data.val_max_samples)")
    check(tr.total_epochs >= 1, "trainer.total_epochs must be >= 1")
    check(tr.total_training_steps is None or tr.total_training_steps >= 1,
          f"trainer.total_training_steps={tr.total_training_steps} must be >= 1 (or null: trainer.total_epochs "
          "passes over the data)")
    check(tr.max_nonfinite_updates_in_a_row >= 0, "trainer.max_nonfinite_updates_in_a_row must be >= 0 "
                                                  "(0 = never stop, skip every non-finite update)")
    check.choice(d.missing_chat_template, ("error", "join"), "data.missing_chat_template")
    check(tr.critic_warmup >= 0, "trainer.critic_warmup must be >= 0")


def _check_environment(cfg: Config, check: Checks) -> None:
    """data.environment: a verifiers taskset in place of the data files, its rollouts as the episodes."""
    from .normalise import ENVIRONMENT_PROGRAM

    d, agent = cfg.data, cfg.actor_rollout_ref.rollout.agent
    check(d.environment.startswith("verifiers:") and len(d.environment) > len("verifiers:"),
          f"data.environment={d.environment!r}: expected 'verifiers:<module or taskset id>'", "wrong values")
    check(not d.train_files and not d.val_files, "data.environment takes the place of data.train_files and "
                                                 "data.val_files (its tasks are the prompts); set one or the other")
    check(agent.program == ENVIRONMENT_PROGRAM, "data.environment runs its own agent program; leave "
                                                f"actor_rollout_ref.rollout.agent.program unset (got {agent.program!r})")


def _check_judge(rm, check: Checks) -> None:
    """reward_model.judge.*: the template, the parser, the sampling and how the score combines."""
    import re
    from pathlib import Path

    from ..reward.judge import COMBINE, template_problem

    j = rm.judge
    check(rm.enable, "reward_model.judge.enable=True needs reward_model.enable=True and reward_model.model.path "
                     "(a causal LM)")
    check.choice(j.combine, COMBINE, "reward_model.judge.combine")
    check(j.response_length > 0, "reward_model.judge.response_length must be positive (tokens the judge may write)")
    check(j.temperature >= 0, "reward_model.judge.temperature must be >= 0 (0 = greedy)")
    check(0 < j.top_p <= 1, "reward_model.judge.top_p must lie in (0, 1]")
    check(j.top_k == -1 or j.top_k > 0, "reward_model.judge.top_k must be positive (or -1: off)")
    check(not rm.use_dynamic_bsz, "reward_model.use_dynamic_bsz is for the scalar reward model; the judge "
                                  "generates reward_model.micro_batch_size_per_gpu prompts at a time")
    check(rm.max_length is None, "reward_model.max_length is for the scalar reward model; the judge reads its "
                                 "whole prompt (bound the response with data.max_response_length)")
    check(not rm.model.input_tokenizer, "reward_model.model.input_tokenizer is for the scalar reward model; the "
                                        "judge reads the responses decoded with the actor's tokenizer")
    template = j.prompt_template
    if j.prompt_template_path:
        check(j.prompt_template is None, "reward_model.judge: set prompt_template or prompt_template_path, not both")
        path = Path(str(j.prompt_template_path)).expanduser()
        if check(path.is_file(), f"reward_model.judge.prompt_template_path: '{path}' does not exist (or is not a "
                                 "file)", "files, models and packages"):
            template = path.read_text(encoding="utf-8")
    if template is not None:
        problem = template_problem(str(template))
        key = "prompt_template_path" if j.prompt_template_path else "prompt_template"
        check(problem is None, f"reward_model.judge.{key}: {problem}", "wrong values")
    if j.score_regex is not None:
        check(not j.parse_function.path, "reward_model.judge: set score_regex or parse_function.path, not both")
        try:
            re.compile(str(j.score_regex))
        except re.error as e:
            check(False, f"reward_model.judge.score_regex={j.score_regex!r} is not a regular expression ({e})",
                  "wrong values")
    if j.parse_function.path:
        check(_parse_function_problem(str(j.parse_function.path), j.parse_function.name) is None,
              _parse_function_problem(str(j.parse_function.path), j.parse_function.name) or "",
              "files, models and packages")


def _parse_function_problem(path: str, name: str) -> str | None:
    """What keeps `path` from giving the judge's parse function `name` (read, not run), or None."""
    import ast
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.is_file():
        return f"reward_model.judge.parse_function.path: '{path}' does not exist (or is not a file)"
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (SyntaxError, UnicodeDecodeError) as e:
        return f"reward_model.judge.parse_function.path: {file} cannot be read as Python ({e})"
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    imported = {(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    if name not in defined | assigned | imported:
        return (f"reward_model.judge.parse_function.name: {file} defines no function {name!r} (functions there: "
                f"{sorted(defined)})")
    return None


def _check_policy_loss(actor, check: Checks) -> None:
    """The constants the policy losses read (clip_cov / kl_cov / sapo)."""
    pl, key = actor.policy_loss, "actor_rollout_ref.actor.policy_loss"
    check(0 < pl.clip_cov_ratio <= 1, f"{key}.clip_cov_ratio must lie in (0, 1] (a share of the tokens)")
    check(0 < pl.kl_cov_ratio <= 1, f"{key}.kl_cov_ratio must lie in (0, 1] (a share of the tokens)")
    check(pl.clip_cov_lb < pl.clip_cov_ub, f"{key}.clip_cov_lb must be below clip_cov_ub")
    check(pl.ppo_kl_coef >= 0, f"{key}.ppo_kl_coef must be >= 0")
    check(pl.loss_mode != "dro" or (pl.dro_beta is not None and pl.dro_beta > 0),
          f"{key}.loss_mode=dro needs {key}.dro_beta > 0 (the quadratic log-ratio penalty; got {pl.dro_beta})")
    check(actor.tau_pos > 0 and actor.tau_neg > 0, "actor_rollout_ref.actor.tau_pos and tau_neg must be positive")


def _check_rollout_correction(rc, check: Checks) -> None:
    """Truncated IS (token / sequence), rejection sampling and its veto, bypass mode with the configured loss
    (bypass with IS: a note says the weights are not applied) or with REINFORCE (`loss_type=reinforce`)."""
    key = "algorithm.rollout_correction"
    check(rc.rollout_is in (None, "token", "sequence"), f"{key}.rollout_is={rc.rollout_is!r} is not one of "
                                                        "[null, 'token', 'sequence']")
    from ..algo.rollout_correction import is_bounds

    try:
        lower, upper = is_bounds(rc.rollout_is_threshold)
    except (TypeError, ValueError):
        lower, upper = None, None
        check(False, f"{key}.rollout_is_threshold={rc.rollout_is_threshold!r} is neither a number nor a range "
                     "lower_upper (such as 0.5_4.0)", "wrong values")
    if upper is not None and lower is None:
        check(upper > 0, f"{key}.rollout_is_threshold must be positive")
        check(rc.rollout_is_mode != "mask" or upper >= 1,
              f"{key}.rollout_is_mode=mask needs rollout_is_threshold >= 1, or on-policy tokens (weight 1) would be "
              "masked")
    elif upper is not None:  # IcePop: weights outside [lower, upper] are masked (rollout_is_mode does not apply)
        check(0 < lower <= 1 <= upper, f"{key}.rollout_is_threshold={rc.rollout_is_threshold!r}: a range "
                                       "lower_upper needs 0 < lower <= 1 <= upper, or on-policy tokens (weight 1) "
                                       "would be masked")
    check(rc.rollout_is_mode in ("truncate", "mask"), f"{key}.rollout_is_mode={rc.rollout_is_mode!r} is not one of "
                                                     "['truncate', 'mask']")
    if rc.rollout_rs is not None:
        from ..algo.rollout_correction import rs_bounds

        try:
            rs_bounds(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as e:
            check(False, f"{key}.{e}", "wrong values")
    check(rc.rollout_rs_threshold_lower is None,
          f"{key}.rollout_rs_threshold_lower goes with verl's former levels rollout_rs=token|sequence|geometric; a k1 "
          "option takes its range in rollout_rs_threshold (lower_upper)", "settings that do not fit together")
    veto = rc.rollout_token_veto_threshold
    check(veto is None or veto > 0, f"{key}.rollout_token_veto_threshold must be positive (a ratio pi_old / "
                                    "pi_rollout)")
    check(rc.loss_type in ("ppo_clip", "reinforce"), f"{key}.loss_type={rc.loss_type!r} is not one of ['ppo_clip', "
                                                    "'reinforce']")


def _check_layout(cfg: Config, check: Checks) -> None:
    """Processes, sharding and batch sizes fit together: every data-parallel rank gets as many responses."""
    from ..algo import estimator_info

    arr, tr, d = cfg.actor_rollout_ref, cfg.trainer, cfg.data
    actor = arr.actor
    check(tr.nnodes >= 1 and tr.n_gpus_per_node >= 1, "trainer.nnodes and trainer.n_gpus_per_node must be >= 1")
    world = tr.nnodes * tr.n_gpus_per_node
    tp, fsdp_size = actor.fsdp_config.tp_size, actor.fsdp_config.fsdp_size
    if not check(tp >= 1 and world >= 1 and world % tp == 0, f"actor_rollout_ref.actor.fsdp_config.tp_size={tp} "
                 f"must divide the {world} processes (trainer.nnodes x trainer.n_gpus_per_node)"):
        return
    sp = actor.ulysses_sequence_parallel_size
    for key, value in (("actor_rollout_ref.ref", arr.ref.ulysses_sequence_parallel_size),
                       ("critic", cfg.critic.ulysses_sequence_parallel_size)):
        check(value in (None, sp), f"{key}.ulysses_sequence_parallel_size={value}: every role uses the actor's "
                                   f"sequence-parallel layout ({sp}); remove the key")
    from ..errors import ConfigError
    from ..parallel.context import check_replicas, check_sequence_parallel

    replicas = actor.row_replicas
    try:
        check_sequence_parallel(world, sp=sp, tp=tp, fsdp_size=fsdp_size)
        check_replicas(world, replicas=replicas, tp=tp, sp=sp, fsdp_size=fsdp_size)
    except ConfigError as error:
        check(False, str(error))
        return
    for key, packs in (("actor_rollout_ref.model", arr.model.use_remove_padding),
                       ("critic.model", cfg.critic.model.use_remove_padding)):
        check(sp == 1 or packs, f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp} splits packed rows: "
                                f"it needs {key}.use_remove_padding=True")
    dp = world // (tp * sp * replicas)
    check(tp == 1 or (arr.model.lora_rank == 0 and not arr.model.lora_adapter_path),
          f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank} with tp_size={tp}: LoRA runs with FSDP2 sharding "
          "alone; set actor_rollout_ref.actor.fsdp_config.tp_size=1 (the frozen base shards over every rank)")
    check(fsdp_size in (-1, 0) or (fsdp_size >= 1 and dp % fsdp_size == 0),
          f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} must divide the {dp} data-parallel ranks "
          "(-1 = shard over all of them)")
    roles = [("actor_rollout_ref.actor.fsdp_config", actor.fsdp_config),
             ("actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config),
             ("critic.model.fsdp_config", cfg.critic.model.fsdp_config)]
    for key, fsdp in roles[1:]:
        check(fsdp.tp_size in (1, tp), f"{key}.tp_size={fsdp.tp_size}: every role uses the actor's tensor-parallel "
                                       f"layout ({tp}); remove the key")
        check(fsdp.fsdp_size in (-1, fsdp_size), f"{key}.fsdp_size={fsdp.fsdp_size}: every role uses the actor's "
                                                 f"sharding layout (fsdp_size={fsdp_size}); remove the key")
    for key, fsdp in roles:
        check.choice(fsdp.model_dtype, DTYPES[1:], f"{key}.model_dtype")
        if fsdp.mixed_precision.param_dtype is not None:
            check.choice(fsdp.mixed_precision.param_dtype, DTYPES[1:], f"{key}.mixed_precision.param_dtype")
        check.choice(fsdp.mixed_precision.reduce_dtype, DTYPES[1:], f"{key}.mixed_precision.reduce_dtype")
    if dp > 1:  # responses are split evenly over the ranks, whole prompt groups where they fit (docs/porting.md)
        n = arr.rollout.n
        megatron = ("; the Megatron layout's own data-parallel size: processes / (tensor x pipeline x context "
                    "parallel)" if actor.strategy == "megatron" else "")
        check(d.train_batch_size * n % dp == 0,
              f"data.train_batch_size={d.train_batch_size} x rollout.n={n} responses must be divisible by the {dp} "
              "data-parallel ranks (each generates as many: whole prompts where they fit, else a share of a prompt's "
              f"samples{megatron})")
        check(not cfg.algorithm.filter_groups.enable or d.train_batch_size % dp == 0,
              f"algorithm.filter_groups keeps whole prompt groups per data-parallel rank: data.train_batch_size="
              f"{d.train_batch_size} must be divisible by the {dp} data-parallel ranks")
        check(actor.ppo_mini_batch_size * n % dp == 0,
              f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} x rollout.n={n} responses "
              f"must be divisible by the {dp} data-parallel ranks (a mini-batch's responses are split evenly over "
              f"them, whole prompt groups where they fit{megatron})")
        critic_mini = cfg.critic.ppo_mini_batch_size or actor.ppo_mini_batch_size
        if estimator_info(cfg.algorithm.adv_estimator).needs_critic or cfg.critic.enable:
            check(critic_mini * n % dp == 0, f"critic.ppo_mini_batch_size={critic_mini} x rollout.n={n} responses "
                                             f"must be divisible by the {dp} data-parallel ranks")
    for key in ("save_contents", "load_contents"):
        value = getattr(actor.checkpoint, key)
        for item in value or []:
            check.choice(item, ("model", "optimizer", "extra", "hf_model"),
                         f"actor_rollout_ref.actor.checkpoint.{key} entry")


def _check_async(cfg: Config, check: Checks) -> None:
    """Asynchronous RL (two groups of processes): what is built, and settings that only mean something there."""
    at, group, arr = cfg.async_training, cfg.rollout, cfg.actor_rollout_ref
    if at.partial_rollout:
        check.unsupported(arr.rollout.agent.program is None, "async_training.partial_rollout=True with "
                          "actor_rollout_ref.rollout.agent.program is not supported: weights are swapped between the "
                          "decoding steps of single responses and of the episode loop's episodes "
                          "(multi_turn.enable), not of an agent program's server; set partial_rollout=False")
    check(at.trigger_parameter_sync_step >= 1 and at.require_batches >= 1, "async_training."
          f"trigger_parameter_sync_step={at.trigger_parameter_sync_step} and require_batches={at.require_batches} "
          "must be >= 1")
    mini = arr.actor.ppo_mini_batch_size
    check(at.require_batches == 1 or cfg.data.train_batch_size == at.require_batches * mini,
          f"async_training.require_batches={at.require_batches} x ppo_mini_batch_size={mini} prompts make a "
          f"training step, but data.train_batch_size={cfg.data.train_batch_size}; set it to "
          f"{at.require_batches * mini} or 0")
    check(at.wait_timeout_s > 0, f"async_training.wait_timeout_s={at.wait_timeout_s} must be > 0")
    check(arr.rollout.update_weights_bucket_megabytes >= 1, "actor_rollout_ref.rollout.update_weights_bucket_megabytes="
          f"{arr.rollout.update_weights_bucket_megabytes} must be >= 1")
    check(group.n_gpus_per_node >= 0 and group.nnodes >= 1, "rollout.n_gpus_per_node must be >= 0 and rollout.nnodes "
          ">= 1")
    if group.n_gpus_per_node == 0:
        return
    st = at.staleness_threshold
    check(st >= 0, f"async_training.staleness_threshold={st} must be >= 0")
    tr, actor = cfg.trainer, arr.actor
    check.unsupported(group.nnodes == 1 and group.n_gpus_per_node == 1 and tr.nnodes == 1,
                      f"asynchronous RL with rollout.nnodes={group.nnodes} x rollout.n_gpus_per_node="
                      f"{group.n_gpus_per_node} generating and trainer.nnodes={tr.nnodes} x trainer.n_gpus_per_node="
                      f"{tr.n_gpus_per_node} training processes: supported are 1 generating process "
                      "(rollout.nnodes=1, rollout.n_gpus_per_node=1) beside trainer.n_gpus_per_node training "
                      "processes on one node (trainer.nnodes=1); or rollout.n_gpus_per_node=0 for synchronous RL over "
                      "any number of processes")
    fsdp_size, sp = actor.fsdp_config.fsdp_size, actor.ulysses_sequence_parallel_size
    check.unsupported(fsdp_size in (-1, 0, tr.n_gpus_per_node) and sp == 1, "asynchronous RL (rollout.n_gpus_per_node"
                      f" > 0) with actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size} or "
                      f"ulysses_sequence_parallel_size={sp} is not supported: the training processes shard the model "
                      "over all of them (FSDP2, fsdp_size=-1) and nothing else; set fsdp_size=-1, "
                      "ulysses_sequence_parallel_size=1")
    sharded = [key for key, fsdp in (("actor_rollout_ref.actor", actor.fsdp_config), ("actor_rollout_ref.ref",
                                                                                      arr.ref.fsdp_config),
                                     ("critic.model", cfg.critic.model.fsdp_config))
               if (fsdp.param_offload or fsdp.tp_size > 1)
               and (key != "actor_rollout_ref.ref" or actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)]  # built?
    check.unsupported(not sharded, f"asynchronous RL (rollout.n_gpus_per_node > 0) with {sharded[0]}.fsdp_config"
                      ".param_offload or tp_size > 1 is not supported: the generating process runs its model whole, the "
                      "training processes shard it with FSDP2 alone"
                      if sharded else "")
    check.unsupported(not tr.val_only, "trainer.val_only=True with rollout.n_gpus_per_node > 0: validation runs on "
                      "the training process; set rollout.n_gpus_per_node=0")
