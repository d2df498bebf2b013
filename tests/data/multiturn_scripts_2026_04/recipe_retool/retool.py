"""Stand-in for the user's copy of the ReTool recipe's `recipe/retool/retool.py`, reduced to what a load reads: its
`compute_score`, simplified to 1 for a correct `\\boxed{}` answer and -1 otherwise (the recipe also raises a wrong
answer's score by its tool calls, up to -0.6). The recipe's dataset class
(`CustomRLHFDataset`) is not here: posttrain refuses `data.custom_cls.*` at load. Written for these tests."""

from posttrain.reward.math import compute_score as math_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if math_score(solution_str, str(ground_truth)) > 0 else -1.0
