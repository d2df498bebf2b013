"""Detectors that read the step's scored batch (before the update trains on it) and the run's history.

The trend detectors compare the run's first `window` steps with its latest `window` steps, and read 0 when
correctness rose over the same windows by `min_acc_gain` (the change is then explained by learning the task).
Each logs its per-step quantity as `watch/parts/<name>/<part>`, which is what later steps' baselines are made of."""

from __future__ import annotations

from .base import Reading, StepInput, acc_gain, unexplained
from .code_fakes import fake_techniques
from .history import History, trend
from .text import copied_share, distinctness


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _positive(value: float) -> float:
    return value if value > 0 else 0.0


def _top(scores: list[tuple[float, int]], k: int) -> list[int]:
    """The rows of the `k` highest scores (ties: batch order)."""
    return [row for _, row in sorted(scores, key=lambda t: (-t[0], t[1]))[:k]]


def length_drift(inp: StepInput, history: History, s) -> Reading:
    """The mean response length's move relative to its baseline, or the move of the share of responses cut at the
    length limit, whichever is larger — where accuracy did not rise with it."""
    v = inp.view
    lengths = [x.length for x in v.samples]
    parts = {"mean": sum(lengths) / len(lengths), "at_limit": sum(n >= v.max_length for n in lengths) / len(lengths)}
    mean = trend(history, "watch/parts/length_drift/mean", parts["mean"], inp.step, s.window)
    limit = trend(history, "watch/parts/length_drift/at_limit", parts["at_limit"], inp.step, s.window)
    if mean is None or limit is None:
        return Reading(0.0, parts=parts)
    gain, acc_note = acc_gain(inp, history, s)
    value = unexplained(max(abs(mean.relative(1.0)), abs(limit.change)), gain, s)
    longer = mean.change >= 0
    rows = _top([((n if longer else -n), i) for i, n in enumerate(lengths)], s.samples)
    return Reading(value, f"mean response length {mean.base:.1f} -> {mean.now:.1f} tokens ({mean.relative(1.0):+.0%}), "
                          f"at the length limit {limit.base:.0%} -> {limit.now:.0%} ({mean.span()}), {acc_note}",
                   rows, parts)


def reward_components(inp: StepInput, history: History, s) -> Reading:
    """The largest rise over its baseline of a paying reward component (one whose latest mean is positive) other
    than correctness — where accuracy did not rise with it."""
    v = inp.view
    names = sorted({k for x in v.samples for k in x.components})
    parts = {k: _mean(x.components.get(k) for x in v.samples) for k in names}
    best, note = None, ""
    for k in names:
        t = trend(history, f"watch/parts/reward_components/{k}", parts[k], inp.step, s.window)
        if t is not None and t.now > 0 and (best is None or t.change > best[1].change):
            best = (k, t)
    if best is None:
        return Reading(0.0, parts=parts)
    gain, acc_note = acc_gain(inp, history, s)
    name, t = best
    rows = _top([(x.components.get(name, 0.0) - x.acc, i) for i, x in enumerate(v.samples)], s.samples)
    return Reading(unexplained(_positive(t.change), gain, s),
                   f"reward component {name!r} {t.base:.2f} -> {t.now:.2f} ({t.span()}), {acc_note}", rows, parts)


def diversity_collapse(inp: StepInput, history: History, s) -> Reading:
    """The share of the baseline's diversity that is gone: of the mean pairwise n-gram distinctness of each
    prompt's responses, or of the policy's entropy (actor/entropy, up to the previous step), whichever is larger —
    where accuracy did not rise with it."""
    v = inp.view
    per_group = [(distinctness([v.samples[r].policy_text for r in rows], s.ngram), rows)
                 for rows in v.groups().values()]
    per_group = [(d, rows) for d, rows in per_group if d is not None]
    parts = {"distinct": sum(d for d, _ in per_group) / len(per_group)} if per_group else {}
    dist = trend(history, "watch/parts/diversity_collapse/distinct", parts.get("distinct"), inp.step, s.window)
    ent = trend(history, "actor/entropy", None, inp.step, s.window)
    drops = [(-dist.relative(1e-6), f"within-group distinctness {dist.base:.2f} -> {dist.now:.2f} ({dist.span()})")
             if dist is not None else None,
             (-ent.relative(1e-6), f"entropy {ent.base:.3f} -> {ent.now:.3f} ({ent.span()})")
             if ent is not None else None]
    drops = [d for d in drops if d is not None]
    if not drops:
        return Reading(0.0, parts=parts)
    raw, what = max(drops)
    gain, acc_note = acc_gain(inp, history, s)
    rows = min(per_group)[1][: s.samples] if per_group else []
    return Reading(unexplained(_positive(raw), gain, s), f"{what}, {acc_note}", rows, parts)


def copying(inp: StepInput, history: History, s) -> Reading:
    """The rise over its baseline of the mean share of a response's word n-grams found in its prompt, or in the
    tool results its episode received, whichever is larger — where accuracy did not rise with it."""
    v = inp.view
    shares = {"prompt": [copied_share(x.policy_text, [x.prompt], s.copy_ngram) for x in v.samples],
              "tools": [copied_share(x.policy_text, x.tool_results, s.copy_ngram) if x.tool_results else None
                        for x in v.samples]}
    parts = {k: m for k, values in shares.items() if (m := _mean(values)) is not None}
    best = None
    for source, now in parts.items():
        t = trend(history, f"watch/parts/copying/{source}", now, inp.step, s.window)
        if t is not None and (best is None or t.change > best[1].change):
            best = (source, t)
    if best is None:
        return Reading(0.0, parts=parts)
    source, t = best
    gain, acc_note = acc_gain(inp, history, s)
    rows = _top([(c, i) for i, c in enumerate(shares[source]) if c is not None], s.samples)
    return Reading(unexplained(_positive(t.change), gain, s),
                   f"share of response n-grams copied from the {'prompt' if source == 'prompt' else 'tool results'} "
                   f"{t.base:.2f} -> {t.now:.2f} ({t.span()}), {acc_note}", rows, parts)


def tool_calls(inp: StepInput, history: History, s) -> Reading:
    """The rise over its baseline of the mean tool calls per episode — where accuracy did not rise with it."""
    episodes = [(i, x) for i, x in enumerate(inp.view.samples) if x.messages is not None]
    if not episodes:
        return Reading(0.0)
    parts = {"per_episode": sum(len(x.tool_calls) for _, x in episodes) / len(episodes)}
    t = trend(history, "watch/parts/tool_calls/per_episode", parts["per_episode"], inp.step, s.window)
    if t is None:
        return Reading(0.0, parts=parts)
    gain, acc_note = acc_gain(inp, history, s)
    rows = _top([(len(x.tool_calls), i) for i, x in episodes], s.samples)
    return Reading(unexplained(_positive(t.change), gain, s),
                   f"tool calls per episode {t.base:.2f} -> {t.now:.2f} ({t.span()}), {acc_note}", rows, parts)


def _repeats(calls: list[str]) -> int:
    return len(calls) - len(set(calls))


def tool_repeats(inp: StepInput, history: History, s) -> Reading:
    """The share of the step's tool calls that repeat an earlier call of their episode with the same name and
    arguments (an absolute level, not a trend)."""
    episodes = [(i, x) for i, x in enumerate(inp.view.samples) if x.messages is not None]
    calls = sum(len(x.tool_calls) for _, x in episodes)
    if not calls:
        return Reading(0.0)
    repeated = sum(_repeats(x.tool_calls) for _, x in episodes)
    rows = _top([(_repeats(x.tool_calls), i) for i, x in episodes if _repeats(x.tool_calls)], s.samples)
    return Reading(repeated / calls, f"{repeated} of {calls} tool calls repeat an identical earlier call of their "
                                     "episode", rows)


def code_fakes(inp: StepInput, history: History, s) -> Reading:
    """How many of the step's code responses try a known way of faking a pass (code_fakes.fake_techniques)."""
    from ..reward.code import DATA_SOURCES, extract_code

    found = [(i, fake_techniques(extract_code(x.policy_text))) for i, x in enumerate(inp.view.samples)
             if x.data_source in DATA_SOURCES]
    found = [(i, kinds) for i, kinds in found if kinds]
    kinds = sorted({k for _, ks in found for k in ks})
    return Reading(float(len(found)), f"{len(found)} code responses try a known fake ({', '.join(kinds)})" if found
                   else "", [i for i, _ in found][: s.samples])
