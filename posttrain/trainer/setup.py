"""From a config to what the RL loop runs on, on this rank: the process layout, the run folder, the data, the
reward, the roles (which dtypes, where each model lives) and the sampling settings (`build_rl_parts`)."""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from ..algo import EstimatorInfo, estimator_info, make_kl_controller
from ..algo.bypass import BypassSettings
from ..config import ConfigError, to_yaml
from ..config.distillation import settings as distill_settings, teachers as configured_teachers
from ..config.rollout_engine import engine_name
from ..data.custom_dataset import CustomRows
from ..data.dataset import RLDataset
from ..data.sampler import PromptOrder
from ..models.compile import compile_decoder_layers, compile_wanted
from ..models.hub import resolve_model_source
from ..models.load import LoraSettings, compute_dtype, load_causal_lm, load_tokenizer, model_config
from ..models.moe import reject_tensor_parallel
from ..models.policy import PolicyModel, ValueModel
from ..models.vision import freeze_vision_tower, load_vision_processor
from ..parallel import Parallel, ShardSettings, init_parallel, prepare_model
from ..parallel.shard import decoder_layers
from ..reward import code as code_reward
from ..reward.judge import judge_reward
from ..reward.manager import RewardManager
from ..reward.model import ModelRewardManager
from ..roles.actor import Actor
from ..roles.common import ModelRunner
from ..roles.critic import Critic
from ..roles.judge_model import Judge
from ..roles.reference import Reference
from ..roles.reward_model import RewardModel
from ..roles.teacher import Teachers, teacher_rows
from ..rollout.base import SamplingParams
from ..agents.environment import ENVIRONMENTS
from ..agents.loop import EpisodeRunner
from ..agents.program import ProgramRunner
from ..agents.tool_agent import toolbox_for
from ..agents.settings import AgentSettings
from ..rollout.registry import build_engine
from .recovery import check_run_dir, clear_run_dir

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def needs_critic(cfg) -> bool:
    return estimator_info(cfg.algorithm.adv_estimator).needs_critic or bool(cfg.critic.enable)


def model_sources(cfg) -> dict[str, str]:
    """Each model or tokenizer path this run loads, by config key, as a local directory: hub ids are fetched here,
    on every rank before any model loads (rank 0 downloads, the others then read the cache), and the loaders find
    them again in resolve_model_source's per-process memo."""
    model = cfg.actor_rollout_ref.model
    keys = {"actor_rollout_ref.model.path": model.path}
    if model.tokenizer_path:
        keys["actor_rollout_ref.model.tokenizer_path"] = model.tokenizer_path
    if needs_critic(cfg) and cfg.critic.model.path:
        keys["critic.model.path"] = cfg.critic.model.path
    for t in configured_teachers(cfg):
        keys[teacher_key(t)] = t.model_path
    rm = cfg.reward_model
    if rm.enable:
        keys["reward_model.model.path"] = rm.model.path
        if rm.model.input_tokenizer:
            keys["reward_model.model.input_tokenizer"] = rm.model.input_tokenizer
    return {key: resolve_model_source(path, key=key) for key, path in keys.items()}


def teacher_key(t) -> str:
    return f"distillation.teacher_models.{t.name}.model_path"


def parallel_for(cfg) -> Parallel:
    """This process's layout: torchrun's world (or one process), the actor's fsdp_size, tp_size and
    ulysses_sequence_parallel_size. One process still shards (FSDP2 over itself) when a trained model is to be
    offloaded to CPU memory."""
    actor_fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    offload = actor_fsdp.param_offload or (needs_critic(cfg) and cfg.critic.model.fsdp_config.param_offload)
    par = init_parallel(device_name=cfg.trainer.device, fsdp_size=actor_fsdp.fsdp_size, tp=actor_fsdp.tp_size,
                        sp=cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size,
                        replicas=cfg.actor_rollout_ref.actor.row_replicas, need_sharding=offload)
    if par.sp_group is not None and par.is_main:  # the log says which layout the run trained with
        print(f"note: Ulysses sequence parallel: each sequence is split over {par.dims.sp} ranks ({par.world} "
              f"processes = {par.dp} data-parallel x {par.dims.sp} sequence-parallel)", file=sys.stderr)
    if par.replica_group is not None and par.is_main:
        print(f"note: row replicas: each data-parallel rank's rows are computed on {par.dims.replicas} ranks, which "
              f"shard the model between them ({par.world} processes = {par.dp} data-parallel x {par.dims.replicas} "
              f"replicas x {par.dims.sp} sequence-parallel x {par.dims.tp} tensor-parallel)", file=sys.stderr)
    return par


def shard_settings(fsdp_cfg, compute: torch.dtype) -> ShardSettings:
    mp = fsdp_cfg.mixed_precision
    param = DTYPES[mp.param_dtype] if mp.param_dtype else compute
    return ShardSettings(param_dtype=param, reduce_dtype=DTYPES[mp.reduce_dtype], offload=fsdp_cfg.param_offload,
                         reshard_after_forward=fsdp_cfg.reshard_after_forward)


def compile_layers(model, fsdp_cfg, actor_fsdp_cfg, par: Parallel, dtype: torch.dtype, role: str) -> None:
    """A role's `fsdp_config.use_torch_compile` (null: the actor's; the actor's null: by model size and compute
    dtype on a CPU, models/compile.py) applied to its decoder layers."""
    setting = next((v for v in (fsdp_cfg.use_torch_compile, actor_fsdp_cfg.use_torch_compile) if v is not None), None)
    if not compile_wanted(setting, model, par.device, dtype):
        return
    compile_decoder_layers(decoder_layers(model))
    if setting is None and par.is_main:
        millions = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"note: {role}: the decoder layers' training passes are compiled (torch.compile: a model of "
              f"{millions:.0f}M parameters training in fp32 on a CPU; use_torch_compile=False keeps them eager)",
              file=sys.stderr)


def _moves_adam(fsdp_cfg) -> bool:
    """optimizer_offload alone: Adam's state goes to CPU memory between steps. With param_offload it lives there
    already (FSDP2 steps the optimizer on the CPU)."""
    return fsdp_cfg.optimizer_offload and not fsdp_cfg.param_offload


class Roles:
    """The models of one run on this rank: actor (+ rollout over the same weights), reference, critic, reward
    model or judge."""

    def __init__(self, cfg, par: Parallel, tokenizer, total_steps: int):
        arr, tr = cfg.actor_rollout_ref, cfg.trainer
        self.dtype = compute_dtype(arr.model.dtype, par.device)
        temperature = arr.rollout.temperature if arr.rollout.temperature > 0 else 1.0
        model_cfg = arr.model
        reject_tensor_parallel(model_config(model_cfg.path, trust_remote_code=model_cfg.trust_remote_code,
                                            key="actor_rollout_ref.model.path"),
                               arr.actor.fsdp_config.tp_size, "actor_rollout_ref.actor.fsdp_config.tp_size")
        lora = (LoraSettings(model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules,
                             model_cfg.exclude_modules, model_cfg.lora_adapter_path)
                if model_cfg.lora_rank > 0 or model_cfg.lora_adapter_path else None)

        def policy(fsdp_cfg, *, trainable: bool, with_lora):
            def build(meta: bool):
                torch.manual_seed(tr.seed)  # LoRA's random init is the same at any world size (rank 0 builds it)
                model = PolicyModel(load_causal_lm(
                    model_cfg.path, meta=meta, dtype=DTYPES[fsdp_cfg.model_dtype],
                    trust_remote_code=model_cfg.trust_remote_code, override_config=model_cfg.override_config,
                    gradient_checkpointing=trainable and model_cfg.enable_gradient_checkpointing,
                    lora=with_lora, key="actor_rollout_ref.model.path"))
                if trainable and arr.actor.freeze_vision_tower:
                    freeze_vision_tower(model)
                return model

            settings = shard_settings(fsdp_cfg, self.dtype)
            model = prepare_model(build, par, settings)
            compile_layers(model, fsdp_cfg, arr.actor.fsdp_config, par, settings.param_dtype,
                           "actor" if trainable else "reference")
            return ModelRunner(model, par, dtype=self.dtype, balance_batch=tr.balance_batch,
                               remove_padding=model_cfg.use_remove_padding)

        a = arr.actor
        actor_runner = policy(a.fsdp_config, trainable=True, with_lora=lora)
        distill = distill_settings(cfg).check() if cfg.distillation.enabled else None
        self.actor = Actor(actor_runner, a, temperature=temperature, max_response_length=cfg.data.max_response_length,
                           total_steps=total_steps, seed=tr.seed, offload_optimizer=_moves_adam(a.fsdp_config),
                           max_nonfinite_in_a_row=tr.max_nonfinite_updates_in_a_row, distill=distill,
                           bypass=BypassSettings.of(cfg.algorithm.rollout_correction))
        self.teachers = _teachers(cfg, par, distill, tokenizer) if distill is not None else None
        self.reference = None
        if a.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            ref_runner = actor_runner if lora else policy(arr.ref.fsdp_config, trainable=False, with_lora=None)
            self.reference = Reference(ref_runner, arr.ref, temperature=temperature, adapter_off=lora is not None)
        self.critic = None
        if needs_critic(cfg):
            c, cm = cfg.critic, cfg.critic.model

            def build_value(meta: bool):
                torch.manual_seed(tr.seed + 1)
                return ValueModel.from_pretrained(cm.path or model_cfg.path, meta=meta,
                                                  dtype=DTYPES[cm.fsdp_config.model_dtype],
                                                  trust_remote_code=cm.trust_remote_code,
                                                  override_config=cm.override_config,
                                                  gradient_checkpointing=cm.enable_gradient_checkpointing,
                                                  key="critic.model.path" if cm.path else "actor_rollout_ref.model.path")

            critic_settings = shard_settings(cm.fsdp_config, self.dtype)
            value = prepare_model(build_value, par, critic_settings)
            compile_layers(value, cm.fsdp_config, arr.actor.fsdp_config, par, critic_settings.param_dtype, "critic")
            self.critic = Critic(ModelRunner(value, par, dtype=self.dtype, balance_batch=tr.balance_batch,
                                             remove_padding=cm.use_remove_padding), c, a,
                                 max_response_length=cfg.data.max_response_length, total_steps=total_steps,
                                 seed=tr.seed, offload_optimizer=_moves_adam(cm.fsdp_config),
                                 max_nonfinite_in_a_row=tr.max_nonfinite_updates_in_a_row)
        rm = cfg.reward_model
        self.reward_model = (RewardModel.from_config(cfg, par, tokenizer, balance_batch=tr.balance_batch)
                             if rm.enable and not rm.judge.enable else None)
        self.judge = Judge.from_config(cfg, par) if rm.enable and rm.judge.enable else None
        r = arr.rollout
        self.engine = build_engine(engine_name(cfg), actor_runner.model, tokenizer, device=par.device,
                                    dtype=compute_dtype(r.dtype, par.device), micro_batch_size=r.micro_batch_size,
                                    enforce_eager=r.enforce_eager, config=cfg)
        self.actor.gather_for_generation = self.engine.decodes_policy_weights

    @property
    def trained(self) -> dict:
        """What a checkpoint holds: the roles with weights and an optimizer."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}


def _teachers(cfg, par: Parallel, distill, tokenizer) -> Teachers:
    """The frozen teachers, placed like the reference (its fsdp_config: sharded over the ranks, offload) with their
    weights and compute in the rollout's dtype; each must use the student's tokenizer (`tokenizer`), and one whose
    embedding is padded further has its output head cut to the student's rows (roles/teacher.py, teacher_rows)."""
    arr = cfg.actor_rollout_ref
    dtype = compute_dtype(arr.rollout.dtype, par.device)
    ref = arr.ref.fsdp_config
    student_vocab = model_config(arr.model.path, trust_remote_code=arr.model.trust_remote_code,
                                 key="actor_rollout_ref.model.path").get_text_config().vocab_size
    runners, keys = {}, {}
    for t in configured_teachers(cfg):
        key = teacher_key(t)
        vocab = model_config(t.model_path, trust_remote_code=arr.model.trust_remote_code,
                             key=key).get_text_config().vocab_size
        try:
            own = load_tokenizer(t.model_path, arr.model.trust_remote_code, key=key)
        except Exception as e:  # noqa: BLE001 - a folder without a tokenizer
            raise ConfigError(f"{key}: the teacher's tokenizer does not load ({type(e).__name__}: {e}); it is "
                              "compared with the student's, whose token ids the teacher scores") from None
        rows = teacher_rows(tokenizer, own, student_vocab, vocab, key)

        def build(meta: bool, path=t.model_path, key=key, rows=rows):
            lm = load_causal_lm(path, meta=meta, dtype=dtype, trust_remote_code=arr.model.trust_remote_code, key=key)
            if rows is not None:  # the teacher's padded rows past the student's vocabulary: never scored
                lm.resize_token_embeddings(rows, mean_resizing=False)
            return PolicyModel(lm)

        model = prepare_model(build, par, ShardSettings(param_dtype=dtype, reduce_dtype=torch.float32,
                                                        offload=ref.param_offload,
                                                        reshard_after_forward=ref.reshard_after_forward))
        model.requires_grad_(False)  # never trained (and so free to compute whole rows under sequence parallel)
        runners[t.name] = ModelRunner(model, par, dtype=dtype, balance_batch=cfg.trainer.balance_batch)
        keys[t.name] = t.key
    return Teachers(runners, keys, arr.ref, teacher_key=cfg.distillation.teacher_key,
                    topk=distill.topk if distill.uses_topk else 0)


def preflight(cfg) -> None:
    """Settings the loop cannot run with, rejected before any model is loaded."""
    if not cfg.actor_rollout_ref.model.path:
        raise ConfigError("actor_rollout_ref.model.path is required (a local Hugging Face model directory or a hub "
                          "id such as Qwen/Qwen2.5-0.5B-Instruct)")
    if not cfg.data.train_files and not cfg.data.environment:
        raise ConfigError("data.train_files (or data.environment) is required")


@dataclass
class RLParts:
    """What the RL loop runs on, on this rank (`build_rl_parts`)."""

    run_dir: Path
    tokenizer: object
    train_data: RLDataset
    val_data: RLDataset | None
    vision: bool  # prompts carry images (a vision-language model's processor was found)
    order: PromptOrder  # which training prompts each draw takes (data.shuffle, or data.sampler's class)
    steps_per_epoch: int
    total_steps: int
    rule_reward: RewardManager  # validation scores with it (as in verl)
    reward: object  # what scores training rollouts: the rule reward, or a reward model or judge over it
    actor: Actor
    reference: Reference | None
    critic: Critic | None
    engine: object  # the decoding engine, over the actor's weights
    trained: dict  # what a checkpoint holds: the roles with weights and an optimizer
    kl_ctrl: object
    info: EstimatorInfo  # what the advantage estimator reads
    sampling: SamplingParams
    val_sampling: SamplingParams
    max_new: int  # response tokens
    needs_old_log_prob: bool  # whether a pass computes the old policy's log-probs
    episodes: EpisodeRunner | ProgramRunner | None = None  # multi-turn rollouts, or agent programs
    teachers: Teachers | None = None  # on-policy distillation's frozen teachers

    @property
    def rule_scoring(self) -> bool:
        """Whether rule scores exist: always without a reward model; with one, when every row has a scorer."""
        return getattr(self.reward, "rule_scoring", True)


def build_rl_parts(cfg, par: Parallel) -> RLParts:
    """Everything the loop needs, in the order that reports mistakes soonest: the run folder and the data, then the
    rule reward (a reward file that fails to import, a data source without a scorer or code rows without a sandbox
    are reported in seconds, not after the models load), then the models. Rank 0 writes the run folder last."""
    arr, tr = cfg.actor_rollout_ref, cfg.trainer
    run_dir = Path(tr.default_local_dir or f"checkpoints/{tr.project_name}/{tr.experiment_name}")
    check_run_dir(cfg, run_dir)  # before any model loads; rank 0 writes there only further down
    torch.manual_seed(tr.seed)
    sources = model_sources(cfg)  # hub ids fetched before anything loads, on every rank
    tok_key = "actor_rollout_ref.model." + ("tokenizer_path" if arr.model.tokenizer_path else "path")
    tokenizer = load_tokenizer(sources[tok_key], arr.model.trust_remote_code, key=tok_key,
                               chat_template=arr.model.custom_chat_template)
    train_data, val_data, vision = _datasets(cfg, par, tokenizer, sources["actor_rollout_ref.model.path"])
    try:
        order = PromptOrder(train_data, cfg.data, cfg.data.train_batch_size)
    except ValueError as e:  # the sampler class fails to build
        raise ConfigError(f"data.sampler.class_name={cfg.data.sampler.class_name}: {e}") from None
    steps_per_epoch = order.batches_per_epoch
    total_steps = tr.total_training_steps or steps_per_epoch * tr.total_epochs
    datasets = [d for d in (train_data, val_data) if d is not None]

    code_reward.configure_from_config(cfg)  # before any scorer process starts: they read it
    rule_reward = _rule_reward(cfg, tokenizer)
    for data in datasets if not cfg.data.environment else ():  # an environment's program scores its episodes
        if not cfg.reward_model.enable:
            rule_reward.check_data_sources(it.data_source for it in data.items)
        if not cfg.custom_reward_function.path:  # code rows, no sandbox: refuse before training
            code_reward.check_ready(it.data_source for it in data.items)

    roles = Roles(cfg, par, tokenizer, total_steps)
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = make_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon)
    reward = (ModelRewardManager(rule_reward, roles.reward_model.score) if roles.reward_model is not None
              else judge_reward(cfg, rule_reward, roles.judge) if roles.judge is not None
              else rule_reward)
    if cfg.reward_model.enable:
        for data in datasets:
            reward.check_data_sources(it.data_source for it in data.items)
    r, rc, a = arr.rollout, cfg.algorithm.rollout_correction, arr.actor
    max_new = r.response_length or cfg.data.max_response_length
    rejects = rc.rollout_rs is not None or rc.rollout_token_veto_threshold is not None
    rollout_logprobs = r.calculate_log_probs or rc.rollout_is is not None or rejects or rc.bypass_mode
    info = estimator_info(cfg.algorithm.adv_estimator)
    # bypass mode: the rollout's log-probs are the old policy's, so no pass computes them
    # router replay R2 records each token's experts in the old-log-prob pass (models/router_replay.py)
    needs_old_log_prob = info.needs_sum_pi_squared or a.router_replay.mode == "R2" or not rc.bypass_mode and (
        a.ppo_epochs > 1 or a.ppo_mini_batch_size < cfg.data.train_batch_size or cfg.algorithm.use_kl_in_reward
        or r.calculate_log_probs or rc.rollout_is is not None or rejects)
    parts = RLParts(
        run_dir=run_dir, tokenizer=tokenizer, train_data=train_data, val_data=val_data, vision=vision, order=order,
        steps_per_epoch=steps_per_epoch, total_steps=total_steps, rule_reward=rule_reward, reward=reward,
        actor=roles.actor, reference=roles.reference, critic=roles.critic, engine=roles.engine, trained=roles.trained,
        kl_ctrl=kl_ctrl, info=info, max_new=max_new, needs_old_log_prob=needs_old_log_prob,
        sampling=SamplingParams.of(r, max_new_tokens=max_new, ignore_eos=r.ignore_eos, logprobs=rollout_logprobs),
        val_sampling=SamplingParams.of(r.val_kwargs, max_new_tokens=max_new, ignore_eos=r.ignore_eos),
        episodes=_episode_runner(cfg, roles.engine, tokenizer), teachers=roles.teachers)
    if cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc" and not parts.rule_scoring:
        raise ConfigError("algorithm.filter_groups.metric=acc needs rule scores, and with reward_model.enable=True "
                          "a data source without a scorer turns them off; use metric=score (the reward model's) or "
                          "set custom_reward_function.path")
    par.barrier()
    if par.is_main:
        if tr.resume_mode == "disable" and tr.overwrite_run_dir:
            clear_run_dir(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return parts


def _episode_runner(cfg, engine, tokenizer) -> EpisodeRunner | ProgramRunner | None:
    """What plays the episodes: agent programs (`rollout.agent.program`) over a server on the engine, else the
    episode loop with `rollout.multi_turn.enable`, else nothing (single responses)."""
    r = cfg.actor_rollout_ref.rollout
    if r.agent.program is not None:
        return ProgramRunner(engine, tokenizer, AgentSettings.from_config(cfg))
    return EpisodeRunner(engine, tokenizer, AgentSettings.from_config(cfg)) if r.multi_turn.enable else None


def _datasets(cfg, par: Parallel, tokenizer, model_dir: str):
    """The training and validation prompts (validation: None without data.val_files), and whether they carry
    images; notes about dropped rows are printed once, by rank 0."""
    d = cfg.data
    processor = load_vision_processor(model_dir, tokenizer,
                                      trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
                                      chat_template=cfg.actor_rollout_ref.model.custom_chat_template)
    data_kwargs = dict(prompt_key=d.prompt_key, reward_fn_key=d.reward_fn_key, max_prompt_length=d.max_prompt_length,
                       filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
                       return_raw_chat=d.return_raw_chat, image_key=d.image_key,
                       apply_chat_template_kwargs=d.apply_chat_template_kwargs,
                       missing_chat_template=d.missing_chat_template, processor=processor)
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:  # prompts rendered with the tools episodes offer
        data_kwargs |= dict(tools=toolbox_for(AgentSettings.from_config(cfg)).schemas() or None,
                            agent_names=ENVIRONMENTS)
    with tempfile.TemporaryDirectory(prefix="posttrain-environment-") as folder:  # read whole while it exists
        train_files, val_files = (_environment_files(cfg, Path(folder)) if d.environment
                                  else (d.train_files, d.val_files))
        if d.custom_cls.path:  # the user's dataset class makes the rows of each set of files
            hf_processor = processor.processor if processor is not None else None
            train_files = CustomRows(d, _file_list(train_files), tokenizer, hf_processor, d.train_max_samples)
            val_files = CustomRows(d, _file_list(val_files), tokenizer, hf_processor,
                                   d.val_max_samples) if val_files else None
        train = RLDataset(train_files, tokenizer, max_samples=d.train_max_samples, **data_kwargs)
        val = RLDataset(val_files, tokenizer, max_samples=d.val_max_samples, **data_kwargs) if val_files else None
    for data in (train, val):
        for note in data.notes if data is not None and par.is_main else ():
            print(f"note: {note}", file=sys.stderr)
    if len(train) < d.train_batch_size:
        raise ConfigError(f"data.train_batch_size={d.train_batch_size} is larger than the training set "
                          f"({len(train)} prompts)")
    return train, val, processor is not None


def _file_list(files) -> list[str]:
    return [files] if isinstance(files, str) else [str(f) for f in files]


def _environment_files(cfg, folder: Path) -> tuple[list[str], list[str]]:
    """data.environment's training and validation rows, written to `folder` as JSONL files the dataset reads like
    any other (no validation file when no task is held out)."""
    from ..agents.verifiers_env import environment_rows

    d = cfg.data
    train, val = environment_rows(d.environment, val_size=d.val_max_samples, train_limit=d.train_max_samples,
                                  max_turns=cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns)
    files = []
    for name, rows in (("train.jsonl", train), ("val.jsonl", val)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        files.append([str(folder / name)] if rows else [])
    return files[0], files[1]


def _rule_reward(cfg, tokenizer) -> RewardManager:
    """The rule reward manager; a custom reward file that fails while it is imported is a ConfigError naming it."""
    try:
        return RewardManager.from_config(cfg, tokenizer)
    except Exception as e:
        path = cfg.custom_reward_function.path
        if not path or isinstance(e, ConfigError):
            raise
        where = next((f"line {tb.lineno}" for tb in reversed(traceback.extract_tb(e.__traceback__))
                      if Path(tb.filename).resolve() == Path(path).expanduser().resolve()), "")
        raise ConfigError(f"custom_reward_function.path: importing {path} failed"
                          f"{' at ' + where if where else ''}: {type(e).__name__}: {e}") from None
