"""Exact match for the local-search example (custom_reward_function.path): the text of the response's last
<answer>...</answer> against the ground truth, both lower-cased with punctuation, articles and extra spaces dropped,
as Search-R1-style QA scores it. The response is the whole episode (search results included), so only an answer the
model wrote inside the tags counts."""

import re
import string


def normalize(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answers = re.findall(r"<answer>(.*?)</answer>", solution_str, re.S)
    return 1.0 if answers and normalize(answers[-1]) == normalize(str(ground_truth)) else 0.0
