"""The scalar reward model: its scores are the classifier's own output on the exchange re-encoded in the reward
model's tokenizer and chat template, sit on the last response token, do not depend on micro-batching, and drive a
GRPO run end to end; the keys of verl's reward-model scripts load."""

import json

import pytest
import torch

from posttrain.config import load_config
from posttrain.data.batch import Batch
from posttrain.data.dataset import collate_prompts, layout_row, PromptItem
from posttrain.parallel import Parallel
from posttrain.reward.manager import RewardManager
from posttrain.reward.model import ModelRewardManager
from posttrain.roles.reward_model import RewardModel

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
CHATS = [[{"role": "user", "content": "1+2="}], [{"role": "system", "content": "add"}, {"role": "user", "content": "33+4="}],
         [{"role": "user", "content": "7+7="}]]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny classifier whose tokenizer was trained on other text than the policy's (other ids for the same
    string) and whose chat template differs, so that re-encoding is visible."""
    from posttrain.data.synthetic import tokenizer_corpus
    from posttrain.models.tiny import build_tiny_reward_model

    out = build_tiny_reward_model(tmp_path_factory.mktemp("rm"), tokenizer_corpus(7, 200), vocab_size=400, seed=3)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + ': ' + m['content'] + "
                               "'<|im_end|>' }}{%- endfor %}")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def rm_config(rm_dir, *extra):
    return load_config(None, ["reward_model.enable=True", f"reward_model.model.path={rm_dir}",
                              "actor_rollout_ref.rollout.dtype=fp32", "actor_rollout_ref.model.dtype=fp32", *extra])


def scored_batch(tok):
    """Three chats with responses of different lengths (one empty), as the rollout leaves them."""
    items = [PromptItem(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"], "x", "0",
                        raw_prompt=c) for c in CHATS]
    prompts, prompt_mask = collate_prompts(items, tok.pad_token_id)
    texts = ["3 because one plus two", "37", ""]
    resp = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(map(len, resp)) + 2
    responses = torch.full((3, width), tok.pad_token_id)
    mask = torch.zeros((3, width), dtype=torch.long)
    for i, r in enumerate(resp):
        n = len(r) if texts[i] else 0  # the third response is empty
        responses[i, :n], mask[i, :n] = torch.tensor(r[:n], dtype=torch.long), 1
    return Batch({"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses, "response_mask": mask},
                 {"uid": ["a", "b", "c"], "raw_prompt": [it.raw_prompt for it in items], "data_source": ["x"] * 3,
                  "ground_truth": ["3", "37", "14"], "extra_info": [{}] * 3}), texts


def plain_scores(rm_dir, policy_tok, batch, max_length=None):
    """The classifier run row by row, without padding, on its own chat template of the decoded exchange."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm_tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    out = []
    for chat, r, m in zip(batch.meta["raw_prompt"], batch["responses"], batch["response_mask"]):
        response = policy_tok.decode(r[m.bool()].tolist(), skip_special_tokens=True)
        text = rm_tok.apply_chat_template([*chat, {"role": "assistant", "content": response}], tokenize=False)
        ids = rm_tok(text, add_special_tokens=False)["input_ids"][:max_length]
        with torch.no_grad():
            out.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return torch.tensor(out)


def test_scores_are_the_classifier_on_the_reencoded_exchange(rm_dir, tiny_tokenizer):
    batch, texts = scored_batch(tiny_tokenizer)
    rm = RewardModel.from_config(rm_config(rm_dir), Parallel(), tiny_tokenizer)
    assert "assistant: 3 because one plus two" in rm.tokenizer.decode(rm.encode(batch)[0])
    assert rm.encode(batch)[0] != tiny_tokenizer(texts[0])["input_ids"]
    expected = plain_scores(rm_dir, tiny_tokenizer, batch)
    assert expected.std() > 0.01  # the rows are told apart
    torch.testing.assert_close(rm.score(batch), expected, rtol=1e-5, atol=1e-5)
    # on the last response token, through the reward manager; rule scoring is off for a source without a scorer
    manager = ModelRewardManager(RewardManager(tiny_tokenizer), rm.score)
    manager.check_data_sources(["x"])
    token_scores, extras = manager(batch)
    lengths = batch["response_mask"].sum(-1)
    assert not manager.rule_scoring and "acc" not in extras
    for i in range(3):
        row = torch.zeros(batch["responses"].shape[1])
        if lengths[i] > 0:
            row[lengths[i] - 1] = expected[i]
        torch.testing.assert_close(token_scores[i], row, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(extras["rm_score"]), expected, rtol=1e-5, atol=1e-5)


def test_the_reward_model_reads_an_episodes_whole_response(rm_dir, tiny_tokenizer):
    """A multi-turn row's response holds tool results between the policy's turns (response_mask 0 there): the
    reward model reads them too, as it reads the whole exchange."""
    tok = tiny_tokenizer
    batch, _ = scored_batch(tok)
    turn, tool = tok("7 then", add_special_tokens=False)["input_ids"], tok(" 30", add_special_tokens=False)["input_ids"]
    ids = turn + tool + turn
    row = batch.select([1])
    row["responses"] = torch.tensor([ids + [tok.pad_token_id]])
    row["response_mask"] = torch.tensor([[1] * len(turn) + [0] * len(tool) + [1] * len(turn) + [0]])
    row["response_attention_mask"] = torch.tensor([[1] * len(ids) + [0]])
    rm = RewardModel.from_config(rm_config(rm_dir), Parallel(), tok)
    assert "assistant: " + tok.decode(ids, skip_special_tokens=True) in rm.tokenizer.decode(rm.encode(row)[0])


@pytest.mark.parametrize("extra", [["reward_model.micro_batch_size_per_gpu=1"], ["reward_model.micro_batch_size_per_gpu=2"],
                                   ["reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=30"]])
def test_micro_batches_do_not_change_scores(rm_dir, tiny_tokenizer, extra):
    batch, _ = scored_batch(tiny_tokenizer)
    whole = RewardModel.from_config(rm_config(rm_dir), Parallel(), tiny_tokenizer).score(batch)
    rm = RewardModel.from_config(rm_config(rm_dir, *extra), Parallel(), tiny_tokenizer)
    parts = rm.runner.micro_parts(Batch({"attention_mask": torch.ones(3, 12)}), rm.cfg.micro_batch_size_per_gpu,
                                  max_tokens=30 if rm.cfg.use_dynamic_bsz else None)
    assert len(parts) > 1
    torch.testing.assert_close(rm.score(batch), whole, rtol=1e-5, atol=1e-5)


def test_max_length_keeps_the_first_tokens(rm_dir, tiny_tokenizer):
    batch, _ = scored_batch(tiny_tokenizer)
    rm = RewardModel.from_config(rm_config(rm_dir, "reward_model.max_length=9"), Parallel(), tiny_tokenizer)
    assert max(len(x) for x in rm.encode(batch)) == 9
    torch.testing.assert_close(rm.score(batch), plain_scores(rm_dir, tiny_tokenizer, batch, max_length=9),
                               rtol=1e-5, atol=1e-5)


def test_rule_scores_stay_metrics_and_the_reward_model_is_the_reward(tiny_tokenizer):
    batch, _ = scored_batch(tiny_tokenizer)
    batch.meta["data_source"] = ["openai/gsm8k"] * 3
    batch.meta["ground_truth"] = ["3", "37", "14"]
    manager = ModelRewardManager(RewardManager(tiny_tokenizer, overlong=(8, 4, 1.0), log_overlong=True),
                                 lambda b: torch.tensor([0.5, -1.0, 2.0]))
    manager.check_data_sources(["openai/gsm8k"])
    token_scores, extras = manager(batch)
    assert manager.rule_scoring and extras["rm_score"] == [0.5, -1.0, 2.0] and "acc" in extras
    lengths = batch["response_mask"].sum(-1)
    penalties = [max(-(n - 4) / 4, -1.0) if n > 4 else 0.0 for n in lengths.tolist()]
    assert extras["overlong_penalty"] == pytest.approx(penalties)
    want = torch.tensor([0.5, -1.0, 0.0]) + torch.tensor(penalties) * (lengths > 0)
    torch.testing.assert_close(token_scores.sum(-1), want)


def test_a_causal_lm_is_refused_as_reward_model(tiny_model_dir, tiny_tokenizer):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="set reward_model.judge.enable=True"):
        RewardModel.from_config(rm_config(tiny_model_dir), Parallel(), tiny_tokenizer)


def test_verl_reward_model_script_keys_load(rm_dir):
    cfg = load_config(None, [
        "algorithm.adv_estimator=gae", "data.return_raw_chat=True", "reward_model.enable=True",
        f"reward_model.model.path={rm_dir}", "reward_model.use_reward_loop=True", "reward_model.rollout.name=vllm",
        "reward_model.rollout.gpu_memory_utilization=0.8", "reward_model.rollout.prompt_length=4096",
        "reward_model.rollout.response_length=4096", "reward_model.rollout.tensor_model_parallel_size=1",
        "reward_model.num_workers=8", "reward_model.model.use_remove_padding=True",
        "reward_model.model.fsdp_config.param_offload=True", "reward_model.micro_batch_size_per_gpu=32",
        "reward_model.model.trust_remote_code=False", "reward_model.use_dynamic_bsz=True",
        "reward_model.forward_max_token_len_per_gpu=98304"])
    rm = cfg.reward_model
    assert rm.enable and rm.model.path == str(rm_dir) and rm.micro_batch_size_per_gpu == 32 and rm.use_dynamic_bsz


def test_grpo_with_a_reward_model_runs(rm_dir, tiny_model_dir, tmp_path):
    from posttrain.trainer.rl import RLTrainer

    rows = [layout_row("openai/gsm8k", f"{a}+{a + 3}=", str(2 * a + 3), {"index": a}) for a in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [
        "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={tiny_model_dir}",
        f"data.train_files={tmp_path / 'train.jsonl'}", f"data.val_files={tmp_path / 'train.jsonl'}",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False", "actor_rollout_ref.model.dtype=fp32",
        "actor_rollout_ref.rollout.dtype=fp32", "reward_model.enable=True", f"reward_model.model.path={rm_dir}",
        "reward_model.micro_batch_size_per_gpu=4", "trainer.total_training_steps=2", "trainer.logger=['jsonl']",
        "trainer.val_before_train=False", "trainer.test_freq=2", f"trainer.default_local_dir={tmp_path / 'run'}"])
    trainer = RLTrainer(cfg)
    val = trainer.fit()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    last = metrics[-1]
    for key in ("reward/rm_score/mean", "reward/rule_score/mean", "reward/acc/mean", "critic/score/mean",
                "actor/pg_loss"):
        assert key in last, key
    assert last["critic/score/mean"] == pytest.approx(last["reward/rm_score/mean"], abs=1e-5)
    assert last["reward/rm_score/mean"] != 0.0
    assert any(k.startswith("val-core/openai/gsm8k/") for k in val)  # validation stays rule-based



def test_dapo_acc_filter_needs_rule_scores_a_reward_model_over_unscored_rows_lacks(rm_dir, tiny_model_dir, tmp_path):
    """filter_groups.metric=acc reads the rule scores; with a reward model, rows of a data source no scorer knows
    leave none, so the run is refused before its first step (naming the metrics that work)."""
    from posttrain.config import ConfigError
    from posttrain.trainer.rl import RLTrainer

    rows = [layout_row("my_source", f"{a}+{a + 3}=", str(2 * a + 3), {"index": a}) for a in range(4)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={tmp_path / 'train.jsonl'}",
        "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "reward_model.enable=True", f"reward_model.model.path={rm_dir}", "algorithm.filter_groups.enable=True",
        "algorithm.filter_groups.metric=acc", f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="metric=acc needs rule scores.*use metric=score"):
        RLTrainer(cfg)
    assert not (tmp_path / "run" / "config.yaml").exists()  # refused before rank 0 writes the run folder

WORKER = '''
import json, sys
import torch
from posttrain.models.load import load_tokenizer
from posttrain.parallel import init_parallel, shutdown
from posttrain.parallel.context import exit_process
from posttrain.roles.reward_model import RewardModel
from tests.test_reward_model import rm_config, scored_batch

rm_dir, policy_dir, out = sys.argv[1:4]
par = init_parallel(device_name="cpu")
tok = load_tokenizer(policy_dir)
batch, _ = scored_batch(tok)
rm = RewardModel.from_config(rm_config(rm_dir, "reward_model.micro_batch_size_per_gpu=1"), par, tok)
assert rm.runner.sharded
rows = [[0, 1], [2]][par.rank]  # uneven shares: rank 1 joins its second micro-batch with an empty part
scores = rm.score(batch.select(rows))
gathered = par.gather((rows, scores.tolist()))
if par.is_main:
    with open(out, "w") as f:
        json.dump(sorted((r, s) for rs, ss in gathered for r, s in zip(rs, ss)), f)
shutdown()
exit_process(0)  # as `posttrain` ends: no interpreter teardown racing gloo's worker threads
'''


def test_two_processes_score_as_one(rm_dir, tiny_model_dir, tiny_tokenizer, tmp_path):
    """Each rank scores its own rows with the FSDP2-sharded reward model; together they give one process's scores."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    batch, _ = scored_batch(tiny_tokenizer)
    one = RewardModel.from_config(rm_config(rm_dir), Parallel(), tiny_tokenizer).score(batch)
    (tmp_path / "worker.py").write_text(WORKER)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(tmp_path / "worker.py"), str(rm_dir), str(tiny_model_dir), str(tmp_path / "out.json")],
                            capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    two = json.loads((tmp_path / "out.json").read_text())
    assert [r for r, _ in two] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([s for _, s in two]), one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_packed_rows_score_as_padded_rows(rm_dir, tiny_tokenizer, dynamic):
    """`reward_model.model.use_remove_padding`: scores of rows packed without padding are the padded rows'."""
    batch, _ = scored_batch(tiny_tokenizer)
    extra = ["reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=40"] if dynamic else []
    padded = RewardModel.from_config(rm_config(rm_dir, "reward_model.model.use_remove_padding=False", *extra),
                                     Parallel(), tiny_tokenizer)
    packed = RewardModel.from_config(rm_config(rm_dir, *extra), Parallel(), tiny_tokenizer)
    expected = padded.score(batch)
    assert padded.packs() is False
    torch.testing.assert_close(packed.score(batch), expected, rtol=1e-5, atol=1e-6)
    assert packed.packs() is True
