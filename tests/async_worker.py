"""What the generating side of tests/test_async_weights.py's two-process scripts shares (they import it under
torchrun): a decoding hook that makes a push land at a known decoding step."""

from posttrain.parallel.groups import send_object


def hold_until_push(inbox, groups, at_call: int):
    """A `between_steps` hook for the generating process: at its `at_call`-th call it tells the trainer (rank 0,
    waiting for "decoding") that decoding has begun and holds that step until version 1 has landed in `inbox`, so
    the push lands mid-generation at that step; every call then swaps in what the inbox staged."""
    calls = 0

    def between_steps(decoding):
        nonlocal calls
        calls += 1
        if calls == at_call:
            send_object("decoding", 0, groups.objects)
            with inbox.cond:
                assert inbox.cond.wait_for(lambda: inbox.staged_version >= 1, timeout=60), "no push within 60 s"
        return inbox.between_steps(decoding)

    return between_steps
