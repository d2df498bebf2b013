#!/usr/bin/env bash
# The 33 code problems bundled with posttrain (posttrain/data/code/problems.jsonl: stdin/stdout, function-call, MBPP-
# and HumanEval-style tests) in the RL data layout: $DATA_DIR/code/train.parquet and test.parquet, data_source
# posttrain/code, scored by running the answer's program in the sandbox. CODE_INPUT names another jsonl file of
# problems in the same format. Extra arguments go to `posttrain prepare` (e.g. --format both).
set -euo pipefail

DATA_DIR=${DATA_DIR:-data}
CODE_INPUT=${CODE_INPUT:-}

posttrain prepare code ${CODE_INPUT:+--input "$CODE_INPUT"} --output-dir "$DATA_DIR/code" "$@"
