"""The two programs a code reward runs in the sandbox around function, assert and checker tests.

Nothing imports this file: `code.py` sends its text (after plain_data.py's) into the sandbox, with one line that
starts one of the two programs. Both read their job (JSON) from stdin and write each result as one line
"<tag> <json>" to a copy of fd 1 taken before any other code runs; the scorer reads only those lines.

* `answer_calls`: the solution's program. It takes the calls to make (a function's name, plain-data arguments) from
  stdin, then imports the solution as module `solution` (its `if __name__ == "__main__":` block stays quiet), runs
  the test setup code, makes each call and writes its outcome: {"value": plain data}, {"raised": exception name} or
  {"error": why}. Expected values never enter this process, and it decides nothing: whatever it writes is only a
  claim about what the functions returned, compared outside.
* `judge`: the tests' program. It runs the setup code and the tests (each assert; the checker's `check(candidate)`)
  with no solution code in its process: each name the tests take from the solution is a proxy that answers from
  `known`, outcomes the solution's program gave for the same arguments, rebuilt from plain data. A call not in
  `known` is listed for the next round and returns a stand-in that lets the test go on (to find its other calls);
  such a test's verdict is "incomplete". The tests' asserts therefore run for real, on plain values.
"""

import builtins
import os
import sys


def _start():
    """The job from stdin and a private copy of fd 1, both taken before any other code runs."""
    job = loads(sys.stdin.read() or "{}")
    fd = os.dup(1)

    def emit(tag, data):
        try:
            line = "\n" + tag + " " + _text(data) + "\n"
        except (TypeError, ValueError):
            line = "\n" + tag + " " + _text({"error": "result not writable"}) + "\n"
        data = line.encode("utf-8", "replace")
        while data:
            data = data[os.write(fd, data):]

    return job, emit


def answer_calls():
    job, emit = _start()
    import types

    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    code = compile(job["solution"], "solution.py", "exec")
    exec(code, module.__dict__)
    if job.get("setup"):
        exec(compile(job["setup"], "test_setup.py", "exec"), module.__dict__)
    instance = []

    def function(name):
        found = module.__dict__.get(name)
        if found is None and "Solution" in module.__dict__:
            if not instance:
                instance.append(module.__dict__["Solution"]())
            found = getattr(instance[0], name, None)
        if not callable(found):
            raise NameError(f"the solution defines no function {name!r}")
        return found

    for number, (name, args, kwargs) in enumerate(job["calls"]):
        try:
            value = function(name)(*decode(args), **decode(kwargs))
        except BaseException as e:  # the call's own failure, SystemExit included, is its outcome
            outcome = {"raised": type(e).__name__}
        else:
            try:
                outcome = {"value": encode(value)}
            except Exception as e:  # NotPlain, or an object that only claims to be plain (a `__class__` property)
                outcome = {"error": "the value is not plain data: " + type(e).__name__}
        emit(job["tag"], [number, outcome])
    emit(job["tag"], ["done"])


class _Pending:
    """Stands for a value the solution has not given yet: agrees with everything, so the test runs on to its
    other calls. Whichever test uses it (a later one too, through a global) is incomplete: no verdict rests on it."""

    def __init__(self, test):
        self._test = test  # the state of the test running now (one dict, reset for each test)

    def _touch(self):
        self._test["incomplete"] = True
        self._test["touches"] += 1
        if self._test["touches"] > 100_000:  # a loop that waits on a pending value: give up on this round
            raise _GiveUp()

    def _same(self, *_, **__):
        self._touch()
        return self

    __call__ = __getattr__ = __getitem__ = __neg__ = __pos__ = __abs__ = __invert__ = _same
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _same
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __round__ = _same
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __lshift__ = __rshift__ = _same

    def __eq__(self, other):
        self._touch()
        return True

    def __ne__(self, other):
        self._touch()
        return False

    __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __eq__

    def __bool__(self):
        self._touch()
        return True

    def __hash__(self):
        self._touch()
        return 0

    def __len__(self):
        self._touch()
        return 0

    def __iter__(self):
        self._touch()
        return iter(())

    def __index__(self):
        self._touch()
        return 0

    __int__ = __index__

    def __float__(self):
        self._touch()
        return 0.0

    def __str__(self):
        self._touch()
        return "<pending>"

    def __format__(self, spec):
        return str(self)

    __repr__ = __str__


class _GiveUp(BaseException):
    """Ends a test that cannot be decided in this round."""


def _exception_named(name):
    """The built-in exception of that name, so a test that expects the solution to raise sees it; others (and
    StopIteration, which would end a `map` or generator the test consumes as if it were exhausted) as RuntimeError."""
    found = getattr(builtins, name, None) if isinstance(name, str) else None
    if isinstance(found, type) and issubclass(found, Exception) and \
            not issubclass(found, (StopIteration, StopAsyncIteration)):
        return found
    return RuntimeError


def judge():
    job, emit = _start()
    import ast

    known = {key: outcome for key, outcome in job["known"]}
    test = {}

    def proxy(name):
        def call(*args, **kwargs):
            if _holds_pending([args, kwargs]):
                test["incomplete"] = True
                return _Pending(test)
            try:
                key_parts = (encode(list(args)), encode(kwargs))
            except NotPlain:
                test["failed"] = "an argument is not plain data"
                raise _GiveUp() from None
            key = call_key(name, *key_parts)
            outcome = known.get(key)
            if outcome is None:
                if key not in test["asked"]:
                    test["asked"][key] = [name, *key_parts]
                test["incomplete"] = True
                return _Pending(test)
            if "value" in outcome:
                return decode(outcome["value"])
            if "raised" in outcome:
                raise _exception_named(outcome["raised"])(f"the solution raised {outcome['raised']}")
            test["failed"] = outcome.get("error") or "no answer"
            raise _GiveUp()

        call.__name__ = name
        return call

    def run(number, body):
        test.clear()
        test.update(incomplete=False, failed="", asked={}, touches=0)
        try:
            body()
            status = "pass"
        except BaseException:  # a failed assert, or anything else the test raised
            status = "fail"
        if test["failed"]:
            status = "fail"
        elif test["incomplete"]:
            status = "incomplete"
        emit(job["tag"], [number, status, list(test["asked"].values())])

    space = {"__name__": "__main__"}

    def bind_free_names(source):
        """Names the test uses and neither it nor the setup defines: a standard module when the test reads an
        attribute of it (tests lean on the solution's `import math`), else a proxy for the solution's function."""
        tree = ast.parse(source)
        modules = {n.value.id for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id not in space and not hasattr(builtins, node.id):
                if node.id in modules and node.id in getattr(sys, "stdlib_module_names", ()):
                    try:
                        space[node.id] = __import__(node.id)
                        continue
                    except ImportError:
                        pass
                space[node.id] = proxy(node.id)

    import random

    random.seed(0)  # every round draws the same random inputs, so their answers are found again
    try:
        exec(compile(job.get("setup") or "", "test_setup.py", "exec"), space)
    except BaseException:
        return  # no test can run: none is reported, so each fails
    if job["kind"] == "check":
        def checker():
            bind_free_names(job["check"])
            exec(compile(job["check"], "check.py", "exec"), space)
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(0)
            space["check"](proxy(job["entry_point"]))

        run(0, checker)
    else:
        for number, source in enumerate(job["tests"]):
            def one_assert(source=source):
                bind_free_names(source)
                exec(compile(source, "test.py", "exec"), space)

            run(number, one_assert)


def _holds_pending(value, depth=0):
    if isinstance(value, _Pending):
        return True
    if depth > 64:
        return False
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    return isinstance(value, (list, tuple, set, frozenset)) and any(_holds_pending(v, depth + 1) for v in value)
