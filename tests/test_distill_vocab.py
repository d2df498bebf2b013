"""The teacher of on-policy distillation scores the student's token ids, so the load check compares the tokenizers
themselves (the token of every id, the special tokens), not only the embedding sizes; and a teacher whose embedding
is padded beyond the student's (Qwen2.5-7B's 152064 rows teaching Qwen2.5-1.5B's 151936) is taken, its extra rows
cut off, so it scores over the student's vocabulary."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.roles.teacher import teacher_rows, tokenizer_difference
from posttrain.trainer.rl import RLTrainer
from tests.test_algo_trainer_wiring import three_prompt_config

PAD_ROWS = 16


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, tiny_model_dir):
    """`swapped`: the student's model with a tokenizer of the same size whose two tokens trade ids; `padded`: the
    student's model with 16 more embedding rows (tied: the output head too), large enough to take most of the
    probability if they were scored."""
    from posttrain.models.load import load_causal_lm

    out = tmp_path_factory.mktemp("teachers")
    swapped = out / "swapped"
    shutil.copytree(tiny_model_dir, swapped)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    padded = out / "padded"
    shutil.copytree(tiny_model_dir, padded)
    model = load_causal_lm(str(tiny_model_dir))
    rows = model.config.vocab_size
    model.resize_token_embeddings(rows + PAD_ROWS, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[rows:] = 50 * torch.randn(PAD_ROWS, model.config.hidden_size,
                                                                      generator=torch.Generator().manual_seed(0))
    model.save_pretrained(padded)
    return {"swapped": swapped, "padded": padded, "rows": rows}


def distilling(tmp_path, student, teacher):
    return three_prompt_config(tmp_path, student, "return 0.0", [
        "algorithm.adv_estimator=grpo", "distillation.enabled=True",
        f"distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.distillation_loss.use_task_rewards=False",
        "actor_rollout_ref.model.dtype=fp32", "actor_rollout_ref.rollout.dtype=fp32"])


def test_a_teacher_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, tiny_model_dir, teachers):
    with pytest.raises(ConfigError, match=r"model_path: the teacher's tokenizer differs .* have other ids"):
        RLTrainer(distilling(tmp_path, tiny_model_dir, teachers["swapped"]))


def test_a_teacher_with_a_padded_embedding_scores_over_the_student_s_vocabulary(tmp_path, tiny_model_dir, teachers):
    """The student's own weights with 16 padded rows as teacher: its scores are the student's log-probs (its padded
    rows, which would take most of the probability, are not part of its distribution)."""
    trainer = RLTrainer(distilling(tmp_path, tiny_model_dir, teachers["padded"]))
    batch, _ = trainer._training_batch({})
    scored = trainer.parts.teachers.score(batch)["teacher_log_probs"].double()
    own = trainer.parts.actor.compute_log_prob(batch)[0].double()
    m = batch["response_mask"].double()
    assert torch.allclose(scored * m, own * m, atol=1e-5)


def test_teacher_rows_and_tokenizer_differences(tiny_tokenizer):
    """Same tokenizer, same size: every row; padded teacher: the student's rows; fewer rows than the student, or a
    token that is special in one tokenizer only, or one more token: refused with the difference named."""
    assert teacher_rows(tiny_tokenizer, tiny_tokenizer, 512, 512, "t") is None
    assert teacher_rows(tiny_tokenizer, tiny_tokenizer, 512, 528, "t") == 512
    with pytest.raises(ConfigError, match="has 504 rows, fewer than the student's 512"):
        teacher_rows(tiny_tokenizer, tiny_tokenizer, 512, 504, "t")
    more = copy.deepcopy(tiny_tokenizer)
    more.add_tokens(["<extra>"])
    assert "the teacher's has ['<extra>'] the student's lacks" in tokenizer_difference(tiny_tokenizer, more)
    special = copy.deepcopy(tiny_tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert "other special tokens" in tokenizer_difference(more, special)
