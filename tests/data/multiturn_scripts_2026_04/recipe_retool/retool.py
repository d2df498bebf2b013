"""Stand-in for the user's copy of the ReTool recipe's `recipe/retool/retool.py` (verl-recipe, commit 48ea0a7,
Apache License 2.0), reduced to what a run reads: its tool class `CustomSandboxFusionTool` over verl's
`SandboxFusionTool` as the recipe writes it (the code taken out of a ```python fence, its last line printed),
its `compute_score`, simplified to 1 for a correct `\\boxed{}` answer and -1 otherwise (the recipe grades with
verl's `math_dapo` and raises a wrong answer's score by its tool calls, up to -0.6), and its dataset class
`CustomRLHFDataset` over verl's `RLHFDataset`. posttrain supplies verl's tool interface and dataset base where verl
is not installed. The recipe's dataset class reads each file with `datasets.load_dataset(path)["train"]` and maps
the AIME files with `map_fn` (another column layout); here the base class reads the files (rows in the standard
layout) and the recipe's `map_fn2` maps them, as the recipe does for every other file. The tool class is the
recipe's, unchanged; the rest was written for these tests."""

import logging
import re
from typing import Any

from verl.tools.base_tool import OpenAIFunctionToolSchema
from verl.tools.sandbox_fusion_tools import SandboxFusionTool
from verl.utils.dataset import RLHFDataset
from verl.utils.rollout_trace import rollout_trace_op

from posttrain.reward.math import compute_score as math_score

logger = logging.getLogger(__name__)


class CustomSandboxFusionTool(SandboxFusionTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self.code_pattern = re.compile(r"```python(.*?)```", re.DOTALL)

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        code = parameters["code"]
        matches = self.code_pattern.findall(code)
        if matches:
            code = matches[0].strip()

        # NOTE: some script may not explicitly print result, we need to add a print statement to the end of the script
        lines = code.split("\n")
        for i, line in reversed(list(enumerate(lines))):
            if line == "":
                continue
            if not lines[i].startswith("print"):
                lines[i] = f"print({line})"
            break
        code = "\n".join(lines)

        timeout = parameters.get("timeout", self.default_timeout)
        language = parameters.get("language", self.default_language)
        if not isinstance(code, str):
            code = str(code)

        result = await self.execution_pool.execute.remote(self.execute_code, instance_id, code, timeout, language)
        # sandbox has no score or metrics, use Nones
        return result, None, None

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
