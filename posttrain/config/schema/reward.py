"""`reward_model.*` and `custom_reward_function.*`: how responses are scored (rules, a reward model, a judge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None
    """sequence classifier with one label (`AutoModelForSequenceClassification`, `num_labels=1`), local or hub id;
    or, with `judge.enable=True`, a causal LM that grades each response (the generative judge)"""
    input_tokenizer: Optional[str] = None
    """tokenizer the policy's ids are decoded with before re-encoding in the reward model's chat template (null = the
    actor's)"""
    trust_remote_code: bool = False
    """allow the reward model's own modelling / tokenizer code"""
    use_remove_padding: bool = True
    """score each micro-batch's rows packed without padding (as `actor_rollout_ref.model.use_remove_padding`), for a
    classifier whose head scores every position (Llama, Qwen2, Mistral, Gemma: `score`); other classifiers, and one
    that fails the one-time check, run on padded rows"""


@dataclass
class SandboxFusionConfig:
    url: Optional[str] = None
    """a SandboxFusion-compatible server (`posttrain sandbox-server`, or SandboxFusion) that runs code rewards;
    unset: the local bubblewrap sandbox"""
    max_concurrent: int = 64
    """requests in flight to the server from one scoring process"""
    memory_limit_mb: int = 1024
    """memory (address space) limit of each program run for code rewards, on the server or locally"""


@dataclass
class CodeSandboxConfig:
    run_timeout: float = 5.0
    """wall-time limit of one program run for code rewards, seconds (CPU time: the same, rounded up)"""
    allow_unsandboxed: bool = False
    """UNSAFE: where no bubblewrap sandbox can start, run model-written code without isolation instead of refusing"""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO overlong shaping (ALGORITHMS.md)"""
    len: int = 0
    """DAPO overlong shaping (ALGORITHMS.md)"""
    penalty_factor: float = 1.0
    """DAPO overlong shaping (ALGORITHMS.md)"""
    log: bool = False
    """log the penalty as `reward/overlong_penalty/mean`"""


@dataclass
class JudgeParseFunctionConfig:
    path: Optional[str] = None
    """python file with a function `parse(text) -> float` (None, an exception or NaN: unparseable); instead of
    `score_regex`"""
    name: str = "parse"
    """the function in `parse_function.path`"""


@dataclass
class JudgeConfig:
    enable: bool = False
    """the reward model (`model.path`, a causal LM) is a generative judge: it answers a prompt filled from
    `prompt_template` for each response, and the answer is parsed into a score (`reward/judge_score/mean`). A verdict
    that cannot be parsed scores 0 and counts in `reward/errors` (share: `reward/judge_unparsed/mean`). Placed like
    the reference (sharded over several processes), decoded by posttrain's rollout engine; validation stays
    rule-based"""
    prompt_template: Optional[str] = None
    """the judge's prompt, with placeholders `{question}` (the last user message), `{response}`, `{ground_truth}` (a
    literal brace is `{{` / `}}`); null = the built-in template, which asks whether the final answer is correct
    against the reference and for one word, `correct` or `incorrect`"""
    prompt_template_path: Optional[str] = None
    """a text file holding the template (instead of `prompt_template`)"""
    use_chat_template: bool = True
    """send the filled template as one user turn in the judge's chat template (False, or a tokenizer without one: the
    text as it is)"""
    score_regex: Optional[str] = None
    r"""parse the verdict with this regular expression: its last match's first group (the whole match without a
    group) read as a number, e.g. `[Ss]core: *(-?[0-9.]+)` or `\[\[([0-9.]+)\]\]`; null = the default parser: the
    last whole word `correct` (1) or `incorrect` (0)"""
    parse_function: JudgeParseFunctionConfig = field(default_factory=JudgeParseFunctionConfig)
    response_length: int = 256
    """most tokens the judge writes per verdict (it stops at its end-of-sequence token)"""
    temperature: float = 0.0
    """the judge's sampling temperature; 0 = greedy (the default)"""
    top_p: float = 1.0
    """the judge's nucleus sampling (with temperature > 0)"""
    top_k: int = -1
    """the judge's top-k sampling (with temperature > 0; -1 = off)"""
    combine: str = "replace"
    """how the judge score j meets the rule score r: `replace` (the training reward is j; rule scores only feed
    metrics, as with the scalar reward model), `add` (r + j), `multiply` (r * j), `gate` (j where r > 0, else r); all
    but `replace` need a rule score for every row. DAPO overlong shaping is added afterwards"""


@dataclass
class RewardModelConfig:
    enable: bool = False
    """a scalar reward model scores each response (on its last token); as in verl its score is the training reward.
    Rule scoring (custom function or data_source scorer) still runs when every data source has a scorer or a custom
    function is set, but only for metrics (`reward/acc/mean`, `reward/rule_score/mean`), gdpo components and
    validation (rule-based; skipped when rule scoring is off). Logs `reward/rm_score/mean`; DAPO overlong shaping is
    added to the model score"""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None
    """rows per reward-model forward on each rank (null = all the rank's rows at once); for the judge, the prompts
    decoded together"""
    max_length: Optional[int] = None
    """keep the first this many tokens of the re-encoded exchange (null = all)"""
    use_dynamic_bsz: bool = False
    """token-budget micro-batches for the reward model"""
    forward_max_token_len_per_gpu: int = 32768
    """token budget of one reward-model micro-batch (with `use_dynamic_bsz`): real tokens when it runs packed
    (`model.use_remove_padding`), else padded positions (rows x longest row)"""
    reward_manager: str = "naive"
    """`naive` / `dapo`: the scorer is called per response (`dapo` is the same call; the overlong shaping is
    `overlong_buffer.*`); `batch`: called once per step with lists (`data_sources`, `solution_strs`, `ground_truths`,
    `extra_infos` keywords), returns a list of scores, time limit `timeout_s` per row; `prime`: per response, always
    in worker processes (needs `num_workers` >= 1 or null); `gdpo`: as `naive`, with `trainer.experiment_name` added
    to each row's `extra_info` as `experiment_name` (verl's gdpo manager; its example scorer reads it)"""
    launch_reward_fn_async: bool = False
    """rejected when True (scoring already runs in worker processes)"""
    num_workers: Optional[int] = None
    """rule-scorer worker processes per training process (null = the CPU cores per process, 2 to 8; 0 = the training
    process scores, with no time limit, so a hanging scorer hangs the run). A hung, raising or crashing scorer scores
    0 and is counted (`reward/timeouts`, `reward/errors`); its worker is replaced. The reward model (`enable=True`)
    runs in the training processes whatever this says"""
    timeout_s: float = 10.0
    """per-response scorer time limit in worker processes (seconds)"""
    max_error_rate: float = 0.5
    """stop the run when more than this share of a step's responses failed to score (raised, timed out, crashed, or
    returned NaN/inf/None/a string/a dict without `score`: each scored 0 and counted); 1 never stops"""
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    code_sandbox: CodeSandboxConfig = field(default_factory=CodeSandboxConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    """python file with the scorer"""
    name: str = "compute_score"
    """`compute_score(data_source, solution_str, ground_truth, extra_info) -> float or dict(score=...)`"""
