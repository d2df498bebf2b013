#!/usr/bin/env bash
# Tiny CPU twin of run_qwen2_5_7b_gsm8k_math_2nodes.sh: that script with its own keys, on the offline tiny model and
# data, 2 steps. It is started twice on this machine, as two "nodes" of one CPU process each (gloo) meeting at a
# local rendezvous, as the script's two launches on two nodes would.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../tiny_cpu/common.sh"
export NGPUS=1 NNODES=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) RUN_ID=tiny_cpu_$$
set -m  # each launch in a process group of its own, so that a failed one can stop the other
bash "$HERE/run_qwen2_5_7b_gsm8k_math_2nodes.sh" "${TINY_ARGS[@]}" "$@" & node0=$!
bash "$HERE/run_qwen2_5_7b_gsm8k_math_2nodes.sh" "${TINY_ARGS[@]}" "$@" & node1=$!
wait -n && first=0 || first=$?
# a launch that failed before the other joined would leave it waiting for the rendezvous
if [ "$first" != 0 ]; then kill -- -"$node0" -"$node1" 2>/dev/null || true; fi
wait -n && second=0 || second=$?
exit $(( first != 0 ? first : second ))
