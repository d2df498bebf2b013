#!/usr/bin/env bash
# GSM8K in the RL data layout: $DATA_DIR/gsm8k/train.parquet (7473 rows) and test.parquet (1319), data_source
# openai/gsm8k, ground truth the number after "####", scored by the GSM8K rule scorer.
# Reads the original files (train.jsonl / test.jsonl with `question` and `answer`, from
# github.com/openai/grade-school-math, grade_school_math/data/) from GSM8K_INPUT: a folder holding them, or one file.
# Left empty, posttrain takes them from the shared/data/gsm8k folder it finds above the current folder or the
# posttrain checkout.
# Extra arguments go to `posttrain prepare` (e.g. --format both for .jsonl copies too).
set -euo pipefail

DATA_DIR=${DATA_DIR:-data}
GSM8K_INPUT=${GSM8K_INPUT:-}

posttrain prepare gsm8k ${GSM8K_INPUT:+--input "$GSM8K_INPUT"} --output-dir "$DATA_DIR/gsm8k" "$@"
