"""What a rank generates when a step's prompt groups straddle ranks (`Parallel.my_samples` gives its runs of
(prompt, first sample, samples)): the prompt rows to sample from, and where each prompt's first sample lies."""

from __future__ import annotations


def prompt_rows(runs: list[tuple[int, int, int]], n: int) -> tuple[list[int], int]:
    """(the prompt of each row to generate from, samples per row): one row per prompt with `n` samples when the
    rank holds whole groups, else one row per (prompt, sample) pair with one sample each. Either way the responses
    come out in prompt order, a prompt's responses next to each other."""
    if all(count == n for _, _, count in runs):
        return [prompt for prompt, _, _ in runs], n
    return [prompt for prompt, _, count in runs for _ in range(count)], 1


def first_sample_rows(runs: list[tuple[int, int, int]], per_prompt: list) -> list[tuple[int, object]]:
    """(this rank's response row, value) for each run's value in `per_prompt` (one per run, such as a greedy
    baseline's scoring failures) whose run holds its prompt's first sample: a value of a prompt whose samples
    straddle ranks is counted once, on the rank that holds sample 0."""
    out, row = [], 0
    for (_, first, count), value in zip(runs, per_prompt):
        if first == 0:
            out.append((row, value))
        row += count
    return out
