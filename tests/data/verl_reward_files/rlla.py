"""Stand-in for the user's copy of verl's `verl/utils/reward_score/rlla.py` (the gdpo example's scorer): the same
signature and result keys (`score`, `format_reward`, `accuracy_reward`), and like the original it needs the run's
name in `extra_info["experiment_name"]` (which verl's gdpo reward manager adds)."""


def compute_score(data_source, solution_str, ground_truth, extra_info, step=0):
    if "experiment_name" not in extra_info:
        raise NotImplementedError("Unknown model name: ''")
    format_reward = float("<tool_call>" in solution_str or "<response>" in solution_str)
    accuracy_reward = float(str(ground_truth).strip() in solution_str)
    return {"score": format_reward + accuracy_reward, "format_reward": format_reward,
            "accuracy_reward": accuracy_reward}
