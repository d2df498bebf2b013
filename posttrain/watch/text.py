"""Word n-grams of responses: how alike the responses of one prompt are, and how much of a response is copied
from what the policy read. Words are runs of letters and digits (`\\w+`), lower-cased; punctuation and markup
(`####`, `<tool_call>`) are not words, so a shared answer format does not count as likeness or copying."""

from __future__ import annotations

import re
from itertools import combinations

_WORD = re.compile(r"\w+")
MAX_PAIRS = 496  # pairs of a group compared (32 responses); a larger group is compared on its first 32


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    """The set of `n`-grams of `tokens`; a text shorter than `n` words is one n-gram of all its words."""
    if not tokens:
        return set()
    n = min(n, len(tokens))
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def distinctness(texts: list[str], n: int) -> float | None:
    """The mean over pairs of texts of the Jaccard distance of their n-gram sets (1 - shared / all): 0 when every
    text is the same, near 1 when no two share a phrase; None for fewer than two texts. Two empty texts are
    alike (distance 0)."""
    sets = [ngrams(words(t), n) for t in texts[:32]]
    if len(sets) < 2:
        return None
    total = 0.0
    pairs = list(combinations(sets, 2))[:MAX_PAIRS]
    for a, b in pairs:
        union = len(a | b)
        total += 1.0 - len(a & b) / union if union else 0.0
    return total / len(pairs)


def copied_share(text: str, sources: list[str], n: int) -> float | None:
    """The share of `text`'s word n-grams found among the n-grams of `sources` (at the same n: `text`'s length
    when it is shorter than `n` words); None for a text without words or no source with words."""
    tokens = words(text)
    if not tokens:
        return None
    n = min(n, len(tokens))
    pool = set()
    for source in sources:
        source_tokens = words(source)
        if len(source_tokens) >= n:
            pool |= {tuple(source_tokens[i:i + n]) for i in range(len(source_tokens) - n + 1)}
    if not pool:
        return None
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return sum(g in pool for g in grams) / len(grams)
