#!/usr/bin/env bash
# MATH-500 in the RL data layout: $DATA_DIR/math/test.parquet (500 rows), data_source
# DigitalLearningGmbH/MATH-lighteval, ground truth the `answer` field, scored with math-verify on the answer's last
# \boxed{}. MATH-500 is a test set only; a MATH training file in the same format (`problem`, `solution`, optional
# `answer`) given as MATH_INPUT=.../train.jsonl becomes $DATA_DIR/math/train.parquet, which the GSM8K + MATH training
# scripts then train on as well.
# Reads the original file(s) from MATH_INPUT: a folder with test.jsonl (and train.jsonl), or one file (named test*
# for the test split, else taken as training data). Left empty, posttrain takes shared/data/math500.
# Extra arguments go to `posttrain prepare` (e.g. --format both).
set -euo pipefail

DATA_DIR=${DATA_DIR:-data}
MATH_INPUT=${MATH_INPUT:-}

posttrain prepare math ${MATH_INPUT:+--input "$MATH_INPUT"} --output-dir "$DATA_DIR/math" "$@"
