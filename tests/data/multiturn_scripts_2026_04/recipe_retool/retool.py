"""Stand-in for the user's copy of the ReTool recipe's `recipe/retool/retool.py`, reduced to what a run reads: its
`compute_score`, simplified to 1 for a correct `\\boxed{}` answer and -1 otherwise (the recipe also raises a wrong
answer's score by its tool calls, up to -0.6), and its dataset class `CustomRLHFDataset` over verl's `RLHFDataset`
(posttrain supplies that base where verl is not installed). The recipe's class reads each file with
`datasets.load_dataset(path)["train"]` and maps the AIME files with `map_fn` (another column layout); here the base
class reads the files (rows in the standard layout) and the recipe's `map_fn2` maps them, as the recipe does for
every other file. Written for these tests."""

from verl.utils.dataset import RLHFDataset

from posttrain.reward.math import compute_score as math_score

answer_format = """\nThe answer format must be: \\boxed{'The final answer goes here.'}"""


def map_fn2(row: dict):
    content = row["prompt"][0]["content"]
    row["prompt"][0]["content"] = content + answer_format
    row["agent_name"] = "tool_agent"
    return row


class CustomRLHFDataset(RLHFDataset):
    """The recipe's dataset class: every prompt asks for a boxed answer and runs the tool agent."""

    def _read_files_and_tokenize(self):
        super()._read_files_and_tokenize()
        self.dataframe = self.dataframe.map(map_fn2, num_proc=16)
        print(f"dataset len: {len(self.dataframe)}")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if math_score(solution_str, str(ground_truth)) > 0 else -1.0
