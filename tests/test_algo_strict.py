"""One calling convention: every registered policy loss takes exactly the documented keywords and every estimator
one AdvantageInputs, so a misspelt keyword or field raises TypeError; registration refuses functions that would
swallow typos (and estimators in the earlier keyword form, saying how to convert them); and the custom loss /
estimator example in docs/algorithms.md runs as written."""

import dataclasses

import inspect
import re
from pathlib import Path

import pytest
import torch
from algo_reference import single_torch_thread  # noqa: F401  (autouse fixture)

from posttrain.algo import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    LossSettings,
    compute_advantage,
    get_policy_loss,
    register_advantage,
    register_policy_loss,
)
from posttrain.algo import advantages as advantages_module

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def estimator_inputs():
    m = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    r = t([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.5, 0.0]])
    return dict(token_level_rewards=r, response_mask=m, index=["a", "a", "b", "b"], values=torch.zeros_like(r),
                reward_baselines=t([0.5, 0.5, 1.0, 1.0]), gamma=1.0, lam=0.95, norm_adv_by_std_in_grpo=True,
                old_log_probs=-torch.ones_like(r), sum_pi_squared=0.3 * torch.ones_like(r), rollout_is_weights=None,
                reward_components=t([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), reward_weights=[1.0, 0.5])


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_takes_one_inputs_object(name):
    fn = ADVANTAGE_ESTIMATORS.get(name)
    params = list(inspect.signature(fn).parameters.values())
    assert [(p.name, p.kind) for p in params] == [("inputs", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    assert {f.name for f in dataclasses.fields(AdvantageInputs)} == set(estimator_inputs())
    adv, ret = fn(AdvantageInputs(**estimator_inputs()))
    assert adv.shape == ret.shape == (4, 3) and torch.isfinite(adv).all()
    with pytest.raises(TypeError, match="norm_adv_by_std"):
        compute_advantage(name, **estimator_inputs(), norm_adv_by_std=False)
    with pytest.raises(dataclasses.FrozenInstanceError):  # an estimator cannot change what the next one reads
        AdvantageInputs(**estimator_inputs()).gamma = 0.5


def loss_inputs():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g, dtype=F64) * 2
    lp = (old + 0.1 * torch.randn(3, 4, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    return lp, old, adv, t([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_policy_loss_has_one_signature_and_rejects_typos(name):
    fn = get_policy_loss(name)
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params[:4]] == ["log_prob", "old_log_prob", "advantages", "response_mask"]
    assert {p.name for p in params[4:]} == {"settings", "norm", "rollout_is_weights"}
    assert all(p.kind == p.KEYWORD_ONLY for p in params[4:])
    settings = LossSettings(dro_beta=0.1) if name == "dro" else LossSettings()  # dro's beta is required
    loss, metrics = fn(*loss_inputs(), settings=settings, norm=None, rollout_is_weights=None)
    assert torch.isfinite(loss) and set(metrics) >= {"actor/ppo_kl"}
    with pytest.raises(TypeError, match="norm_adv_by_std"):
        fn(*loss_inputs(), settings=LossSettings(), norm_adv_by_std=False)
    with pytest.raises(TypeError):  # the old flat keywords are typos now too
        fn(*loss_inputs(), loss_agg_mode="token-mean")
    with pytest.raises(TypeError, match="clip_ratio_hihg"):
        LossSettings(clip_ratio_hihg=0.28)


def test_registration_rejects_signatures_that_swallow_typos():
    with pytest.raises(TypeError, match="must have the signature"):
        @register_policy_loss("_test_loose_loss")
        def loose(log_prob, old_log_prob, advantages, response_mask, **_):
            return log_prob.sum(), {}
    with pytest.raises(TypeError, match="must have the signature"):
        @register_advantage("_test_loose_est")
        def loose_est(*, token_level_rewards, response_mask, **_):
            return token_level_rewards, token_level_rewards
    assert "_test_loose_loss" not in POLICY_LOSSES and "_test_loose_est" not in ADVANTAGE_ESTIMATORS


def test_an_estimator_in_the_earlier_keyword_form_is_refused_with_the_new_form():
    with pytest.raises(TypeError, match=r"signature \(inputs\).*one AdvantageInputs.*inputs\.token_level_rewards"):
        @register_advantage("_test_keyword_est")
        def keyword_est(*, token_level_rewards, response_mask, index=None, values=None, reward_baselines=None,
                        gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True, old_log_probs=None, sum_pi_squared=None,
                        rollout_is_weights=None, reward_components=None, reward_weights=None):
            return token_level_rewards, token_level_rewards
    assert "_test_keyword_est" not in ADVANTAGE_ESTIMATORS


def docs_example() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    section = text.split("## Writing your own loss or estimator", 1)[1].split("\n## ", 1)[0]
    return "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL))


def test_docs_custom_loss_and_estimator_example_runs():
    code = docs_example()
    assert "register_policy_loss" in code and "register_advantage" in code
    namespace: dict = {}
    try:
        exec(compile(code, "docs/algorithms.md", "exec"), namespace)  # noqa: S102  (the docs example itself)
        lp, old, adv, m = loss_inputs()
        fn = get_policy_loss("clipped_pg")
        loss, _ = fn(lp, old, adv, m, settings=LossSettings(clip_ratio_high=0.28), norm=None, rollout_is_weights=None)
        # -A * min(ratio, 1.28) * logp, token-mean: re-derived here in plain Python
        total, count = 0.0, 0
        for i in range(3):
            for j in range(4):
                if m[i, j]:
                    ratio = float(torch.exp(lp[i, j] - old[i, j]))
                    total += -min(ratio, 1.28) * float(adv[i, j]) * float(lp[i, j])
                    count += 1
        assert abs(float(loss) - total / count) < 1e-10
        inputs = estimator_inputs()
        a, _ = compute_advantage("group_max_baseline", **inputs)
        s = inputs["token_level_rewards"].sum(-1).tolist()  # 1, 0 in group a; 2, 0.5 in group b
        expected = [0.0, -1.0, 0.0, -1.5]
        assert torch.allclose(a, t(expected).unsqueeze(-1) * inputs["response_mask"]), (a, s)
        with pytest.raises(TypeError):
            compute_advantage("group_max_baseline", **inputs, gama=0.9)
    finally:
        POLICY_LOSSES._table.pop("clipped_pg", None)
        ADVANTAGE_ESTIMATORS._table.pop("group_max_baseline", None)
        advantages_module.ESTIMATOR_INFO.pop("group_max_baseline", None)


def test_a_loss_needs_a_name():
    with pytest.raises(ValueError, match="at least one name"):
        register_policy_loss()
