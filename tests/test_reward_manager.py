"""Batch scoring: score placement, dict scores, contained failures (raise / hang), overlong shaping."""

import time

import pytest
import torch

from posttrain.data.batch import Batch
from posttrain.reward.manager import RewardManager, overlong_penalty


class FakeTokenizer:
    """Token id k decodes to chr(ord('a') + k); enough to check what the scorer sees."""

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(ord("a") + t) for t in s) for s in seqs]


def make_batch(responses, mask, sources=None, truths=None):
    n = len(responses)
    return Batch({"responses": torch.tensor(responses), "response_mask": torch.tensor(mask)},
                 {"data_source": sources or ["t"] * n, "ground_truth": truths or ["x"] * n, "extra_info": [{}] * n})


def scorer(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "ab":
        return 1.0
    if solution_str == "c":
        return {"score": 0.5, "format_ok": True}
    if solution_str == "d":
        raise RuntimeError("boom")
    if solution_str == "e":
        time.sleep(30)
    return 0.0


def hanging_scorer(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "e":
        time.sleep(30)
    return float(len(solution_str))


def test_scores_land_on_last_valid_token():
    rm = RewardManager(FakeTokenizer(), compute_score=scorer)
    batch = make_batch([[0, 1, 5], [2, 9, 9], [3, 0, 0], [4, 4, 4]], [[1, 1, 0], [1, 0, 0], [1, 0, 0], [0, 0, 0]])
    with pytest.warns(UserWarning, match="reward function raised"):
        scores, extras = rm(batch)
    assert scores.tolist() == [[0, 1.0, 0], [0.5, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert extras["errors"] == [0, 0, 1, 0] and extras["format_ok"] == [0, 1.0, 0, 0]
    assert extras["response_text"] == ["ab", "c", "d", ""]


def test_hanging_scorer_is_contained_in_workers():
    rm = RewardManager(FakeTokenizer(), compute_score=hanging_scorer, num_workers=2, timeout_s=1.0)
    batch = make_batch([[0, 1], [4, 0], [2, 2]], [[1, 1], [1, 0], [1, 1]])
    scores, extras = rm(batch)
    rm.close()
    assert extras["timeouts"] == [0, 1, 0]
    assert scores.sum(-1).tolist() == [2.0, 0.0, 2.0]


def test_overlong_penalty_formula():
    # L_max = 20, L_buf = 5: free up to 15 tokens, then linear down to -factor at 20, never below
    assert overlong_penalty(15, 20, 5, 1.0) == 0.0
    assert overlong_penalty(16, 20, 5, 1.0) == pytest.approx(-0.2)
    assert overlong_penalty(20, 20, 5, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(25, 20, 5, 0.5) == pytest.approx(-0.5)
    rm = RewardManager(FakeTokenizer(), compute_score=lambda *a: 1.0, overlong=(4, 2, 1.0), log_overlong=True)
    scores, extras = rm(make_batch([[0, 0, 0, 0], [0, 0, 0, 0]], [[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert scores.sum(-1).tolist() == [1.0, 0.0] and extras["overlong_penalty"] == [0.0, -1.0]


def test_dict_without_score_is_an_error():
    rm = RewardManager(FakeTokenizer(), compute_score=lambda *a: {"acc": 1})
    with pytest.raises(ValueError, match="without 'score'"):
        rm(make_batch([[0]], [[1]]))


def test_default_dispatch_and_unknown_source(tiny_tokenizer):
    rm = RewardManager(tiny_tokenizer)
    ids = tiny_tokenizer("#### 46", add_special_tokens=False)["input_ids"]
    batch = make_batch([ids, ids], [[1] * len(ids)] * 2, sources=["synthetic/arithmetic", "openai/gsm8k"],
                       truths=["46", "47"])
    scores, _ = rm(batch)
    assert scores.sum(-1).tolist() == [1.0, 0.0]
    rm.check_data_sources(["openai/gsm8k", "synthetic/arithmetic"])
    with pytest.raises(KeyError, match="no reward function for data_source 'nope'.*custom_reward_function.path"):
        rm.check_data_sources(["openai/gsm8k", "nope"])
    RewardManager(tiny_tokenizer, compute_score=scorer).check_data_sources(["nope"])  # a custom function takes all


def test_scorer_acc_is_kept():
    """A scorer's own `acc` wins over `score > 0` (partial credit is not success; DAPO filters on this field);
    rows whose scorer gives no `acc` get `score > 0`."""
    def partial(data_source, solution_str, ground_truth, extra_info):
        return {"score": 0.5, "acc": 0.0} if solution_str == "a" else 1.0

    rm = RewardManager(FakeTokenizer(), compute_score=partial)
    scores, extras = rm(make_batch([[0], [1]], [[1], [1]]))
    assert scores.sum(-1).tolist() == [0.5, 1.0]
    assert extras["acc"] == [0.0, 1.0]
