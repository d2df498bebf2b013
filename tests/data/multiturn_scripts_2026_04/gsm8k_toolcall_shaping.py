"""Stand-in for the user's copy of `examples/sglang_multiturn/gsm8k_toolcall_shaping/gsm8k_toolcall_shaping.py`:
the same `compute_score`, GSM8K's strict score plus 0.1 when the response calls a tool (`<tool_call>` in its text).
The original imports verl's GSM8K scorer; a copy used without verl imports posttrain's, which scores the same.
Written for these tests, not copied."""

from posttrain.reward.gsm8k import compute_score as gsm8k_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    bonus = 0.1 if "<tool_call>" in solution_str else 0.0
    return float(gsm8k_score(solution_str, ground_truth, method="strict", format_score=0.1, score=1.0) + bonus)
