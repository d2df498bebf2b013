"""Builders of tiny things that need the trainer: the offline demos (demo.py: the arithmetic task; tools_task.py and
calculator_tool.py: the calculator task) and the tiny generative judge (judge.py), for the `demo` command, tests,
examples and benchmarks. The trainer knows nothing of them."""
