"""What agents did, seen from outside: the `agent/*` metrics of a step's episodes, the episode log
(RUN_DIR/episodes/step_N.jsonl), and the built-in example environment `guess_number` driven turn by turn."""

import json
import pickle

import numpy as np
import pytest

from posttrain.agents.episode import Episode
from posttrain.agents.episode_log import NoEpisodes, episodes_file, logged_steps, read_episodes, write_episodes
from posttrain.agents.metrics import episode_metrics


def episode(**counters) -> Episode:
    ep = Episode(prompt_ids=[1, 2], messages=[{"role": "user", "content": "q"}], row={"data_source": "s"})
    for name, value in counters.items():
        setattr(ep, name, value)
    return ep


# ------------------------------------------------------------------ metrics


def test_episode_metrics_of_hand_built_episodes():
    """Means over episodes, the maximum of turns, error totals overall and per kind, shares of truncated and
    mismatched episodes, and an environment metric averaged over the episodes that reported it only."""
    eps = [
        episode(assistant_turns=1, tool_calls=0, tool_time_s=0.0, env_reward=0.0, tool_reward=0.9),
        episode(assistant_turns=3, tool_calls=4, tool_errors={"malformed_json": 1, "timeout": 2}, tool_time_s=1.5,
                env_reward=1.0, truncated=True, metrics={"invalid_guess": 0.5}),
        episode(assistant_turns=4, tool_calls=2, tool_errors={"timeout": 1}, tool_time_s=0.3, env_reward=0.5,
                tokenization_mismatch=True, metrics={"invalid_guess": 0.0, "solved": 1.0}),
    ]
    assert episode_metrics(eps) == pytest.approx({
        "agent/turns/mean": 8 / 3, "agent/turns/max": 4.0, "agent/tool_calls/mean": 2.0,
        "agent/tool_errors": 4.0, "agent/tool_errors/malformed_json": 1.0, "agent/tool_errors/timeout": 3.0,
        "agent/tool_time_s": 0.6, "agent/truncated_share": 1 / 3, "agent/tokenization_mismatch": 1 / 3,
        "agent/env_reward/mean": 0.5, "agent/tool_reward/mean": 0.3, "agent/env/invalid_guess": 0.25,
        "agent/env/solved": 1.0,
    })


def test_episode_metrics_of_no_episodes_is_empty():
    assert episode_metrics([]) == {}


# ------------------------------------------------------------------ episode log


class DecodingTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens  # as the scorer reads the response
        return " ".join(f"t{i}" for i in ids)


def tool_episode() -> Episode:
    ep = Episode(prompt_ids=[1, 2, 3], messages=[{"role": "user", "content": "What is 12*13?"}],
                 row={"data_source": "openai/gsm8k", "ground_truth": "156", "agent_name": "tool_agent",
                      "extra_info": {"index": np.int64(4)}})
    ep.add_policy([10, 11], [-0.5, -0.25])
    ep.messages.append({"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'})
    ep.add_appended([20, 21, 22])
    ep.messages.append({"role": "tool", "name": "calc", "content": "156"})
    ep.add_policy([12])
    ep.messages.append({"role": "assistant", "content": "#### 156"})
    ep.assistant_turns, ep.tool_calls, ep.tool_errors, ep.env_reward = 2, 1, {"bad_arguments": 1}, 0.25
    return ep


def test_episode_log_round_trip(tmp_path):
    """One JSON line per episode with its conversation, reward (score + env_reward = total, a scorer's other keys
    kept), turns, tool counts and errors, token counts and the decoded response; numpy values are written as
    numbers; the latest step is read by default, by number (10 after 9)."""
    eps = [tool_episode(), episode(assistant_turns=1, truncated=True)]
    eps[1].row["extra_info"] = {"arr": np.arange(3), "image": b"\x00\x01"}
    write_episodes(episodes_file(tmp_path, 9), eps[:1], [0.0])
    path = write_episodes(episodes_file(tmp_path, 10), eps, [{"score": 1.0, "acc": 1.0}, 0.0], DecodingTokenizer())
    assert path == tmp_path / "episodes" / "step_10.jsonl"
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_10.jsonl", "step_9.jsonl"]  # no temporary left
    assert logged_steps(tmp_path) == [9, 10]
    step, records = read_episodes(tmp_path)
    assert step == 10 and len(records) == 2
    first = records[0]
    assert first["messages"] == eps[0].messages
    assert first["reward"] == {"score": 1.0, "env_reward": 0.25, "total": 1.25, "acc": 1.0}
    assert (first["data_source"], first["ground_truth"], first["agent_name"]) == ("openai/gsm8k", "156", "tool_agent")
    assert first["turns"] == {"assistant": 2, "user": 0}
    assert (first["tool_calls"], first["tool_errors"], first["truncated"]) == (1, {"bad_arguments": 1}, False)
    assert (first["response_tokens"], first["policy_tokens"]) == (6, 3)
    assert first["response"] == "t10 t11 t20 t21 t22 t12"
    assert records[1]["truncated"] is True and records[1]["reward"]["total"] == 0.0
    assert read_episodes(tmp_path, step=9)[1][0]["reward"]["score"] == 0.0


def test_episode_log_replaces_a_step_file_whole(tmp_path):
    path = episodes_file(tmp_path, 1)
    write_episodes(path, [episode(), episode()], [0.0, 1.0])
    write_episodes(path, [episode()], [0.5])
    assert [json.loads(line)["reward"]["score"] for line in path.read_text().splitlines()] == [0.5]


def test_episode_log_refuses_a_reward_count_that_differs():
    with pytest.raises(ValueError, match="2 episodes but 1 rewards"):
        write_episodes("unused.jsonl", [episode(), episode()], [0.0])


def test_reading_a_folder_without_episodes_lists_what_is_there(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "global_step_2").mkdir()
    with pytest.raises(NoEpisodes, match=r"no episodes in .*It holds: global_step_2/, metrics.jsonl"):
        read_episodes(tmp_path)
    write_episodes(episodes_file(tmp_path, 5), [episode()], [0.0])
    with pytest.raises(NoEpisodes, match="no episodes of step 3 .*steps with episodes: 5"):
        read_episodes(tmp_path, step=3)


# ------------------------------------------------------------------ the example environment: guess_number


def start(secret=37, low=1, high=100, **info):
    from posttrain.agents.envs.guess_number import GuessNumber

    env = GuessNumber()
    row = {"extra_info": {"secret": secret, "low": low, "high": high, **info},
           "raw_prompt": [{"role": "user", "content": "Guess my number."}]}
    reset = env.reset(row)
    return env, Episode(prompt_ids=[], messages=list(reset.messages), row=row), reset


def turn(env, ep, text):
    ep.messages.append({"role": "assistant", "content": text})
    step = env.step(ep)
    ep.messages += step.messages
    return step


def test_guess_number_answers_higher_lower_until_right():
    """Each turn's last integer is the guess; the environment answers as the user; a turn without an integer is
    told what to answer (and counted in invalid_guess); the right guess ends the episode with reward 1."""
    env, ep, reset = start(secret=37)
    assert reset.messages == [{"role": "user", "content": "Guess my number."}] and not reset.tools
    answers = []
    for text in ["50", "Between 1 and 49, so 25", "no idea", "Is it 37?"]:
        step = turn(env, ep, text)
        answers.append((step.messages, step.reward, step.done, step.metrics["invalid_guess"]))
    assert answers == [
        ([{"role": "user", "content": "lower"}], 0.0, False, 0.0),
        ([{"role": "user", "content": "higher"}], 0.0, False, 0.0),
        ([{"role": "user", "content": "Answer with one integer between 1 and 100."}], 0.0, False, 1.0),
        ([], 1.0, True, 0.0),
    ]
    env.close()


def test_guess_number_ends_without_reward_when_guesses_run_out():
    env, ep, _ = start(secret=5, max_guesses=2)
    assert turn(env, ep, "1").done is False
    last = turn(env, ep, "2")
    assert (last.done, last.reward, last.messages) == (True, 0.0, [])


def test_guess_number_default_guesses_suffice_for_a_binary_search():
    """With the default number of guesses (7 for 1..100) a player that halves the range always wins, and never
    has a guess to spare at the worst secret: the default is exactly a binary search's worst case."""
    used = []
    for secret in range(1, 101):
        env, ep, _ = start(secret=secret)
        lo, hi, step, guesses = 1, 100, None, 0
        while step is None or not step.done:
            guess = (lo + hi) // 2
            step, guesses = turn(env, ep, f"My guess: {guess}"), guesses + 1
            if step.messages and step.messages[0]["content"] == "higher":
                lo = guess + 1
            elif step.messages:
                hi = guess - 1
        assert step.reward == 1.0, secret
        used.append(guesses)
    assert max(used) == 7
    env, ep, _ = start(secret=100)
    assert [turn(env, ep, "1").done for _ in range(7)] == [False] * 6 + [True]


def test_guess_number_rejects_a_row_without_its_secret():
    from posttrain.agents.envs.guess_number import GuessNumber

    with pytest.raises(ValueError, match="extra_info.secret, low and high"):
        GuessNumber().reset({"extra_info": {"low": 1, "high": 10}})


def test_guess_number_is_registered_with_its_rows_and_scorer():
    """`import posttrain.agents` registers the environment; its rows name it as their agent_name and data_source,
    hold the secret as ground truth, are the same for the same seed; the data_source scores 0 (the environment
    rewards) and reaches scorer worker processes (pickled by reference)."""
    import posttrain.agents  # noqa: F401
    from posttrain.agents.environment import ENVIRONMENTS
    from posttrain.agents.envs.guess_number import GuessNumber, guess_number_rows
    from posttrain.reward.registry import RegisteredScorers, default_compute_score

    assert isinstance(ENVIRONMENTS["guess_number"](None), GuessNumber)
    rows = guess_number_rows(20, low=1, high=10, seed=3)
    assert rows == guess_number_rows(20, low=1, high=10, seed=3) != guess_number_rows(20, low=1, high=10, seed=4)
    for row in rows:
        secret = row["extra_info"]["secret"]
        assert 1 <= secret <= 10 and row["reward_model"]["ground_truth"] == str(secret)
        assert row["agent_name"] == row["data_source"] == "guess_number"
        assert "between 1 and 10" in row["prompt"][0]["content"]
    assert default_compute_score("guess_number", "37", "37") == 0.0
    assert pickle.loads(pickle.dumps(RegisteredScorers()))("guess_number", "37", "37") == 0.0


def test_an_agent_loop_file_registers_its_environments_by_name(tmp_path):
    """verl's agent-loop file layout (`- name:` / `_target_:`): an environment class taking no arguments and a
    factory taking the settings are registered under their names (a second read keeps them); verl's own kind of
    agent-loop class (an async run()), an unknown target and a taken name are refused with the reason."""
    from types import SimpleNamespace

    from posttrain.agents.environment import ENVIRONMENTS, register_from_file

    (tmp_path / "loops.yaml").write_text(
        "- name: guess_again\n  _target_: posttrain.agents.envs.guess_number.GuessNumber\n"
        "- name: single_again\n  _target_: posttrain.agents.tool_agent.SingleTurnAgent\n")
    try:
        assert register_from_file(str(tmp_path / "loops.yaml")) == ["guess_again", "single_again"]
        assert register_from_file(str(tmp_path / "loops.yaml")) == ["guess_again", "single_again"]
        env = ENVIRONMENTS["guess_again"](SimpleNamespace())
        start = env.reset({"extra_info": {"secret": 3, "low": 1, "high": 4}})
        assert start.messages and env.step(episode_saying("3")).done
        assert ENVIRONMENTS["single_again"](SimpleNamespace()).step(episode_saying("x")).done
    finally:
        ENVIRONMENTS.pop("guess_again", None)
        ENVIRONMENTS.pop("single_again", None)
    bad = {"verl's loop": ("- name: mine\n  _target_: tests.test_episodes.VerlStyleLoop\n", "async run()"),
           "unknown": ("- name: mine\n  _target_: no_such_module.Loop\n", "cannot import"),
           "taken": ("- name: tool_agent\n  _target_: posttrain.agents.tool_agent.SingleTurnAgent\n",
                     "already registered")}
    for text, fragment in bad.values():
        (tmp_path / "bad.yaml").write_text(text)
        with pytest.raises(ValueError, match=fragment):
            register_from_file(str(tmp_path / "bad.yaml"))
    assert "mine" not in ENVIRONMENTS


class VerlStyleLoop:
    async def run(self, sampling_params, **kwargs):
        return None


def episode_saying(text: str) -> Episode:
    return Episode(prompt_ids=[1], messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": text}])


def test_the_agent_loop_config_path_key_registers_before_the_run_checks_names(tmp_path, tiny_model_dir):
    """`rollout.agent.agent_loop_config_path` acts: the settings the trainer builds register the file's environments,
    so `default_agent_loop` (and rows' agent_name) may name them; a file that fails to import is a config error."""
    from posttrain.agents.environment import ENVIRONMENTS
    from posttrain.agents.settings import AgentSettings
    from posttrain.config import ConfigError, load_config

    (tmp_path / "loops.yaml").write_text("- name: guess_by_file\n"
                                         "  _target_: posttrain.agents.envs.guess_number.GuessNumber\n")
    keys = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.rollout.multi_turn.enable=True",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={tmp_path / 'loops.yaml'}",
            "actor_rollout_ref.rollout.agent.default_agent_loop=guess_by_file"]
    try:
        assert AgentSettings.from_config(load_config(None, keys)).default_agent_loop == "guess_by_file"
        assert "guess_by_file" in ENVIRONMENTS
    finally:
        ENVIRONMENTS.pop("guess_by_file", None)
    (tmp_path / "loops.yaml").write_text("- name: broken\n  _target_: no_such_module.Env\n")
    with pytest.raises(ConfigError, match="agent_loop_config_path: .*cannot import 'no_such_module.Env'"):
        AgentSettings.from_config(load_config(None, keys[:-1]))
