# Sourced by every *_tiny_cpu.sh script. It provides the offline tiny model and data (built once by build.py into
# $POSTTRAIN_TINY_DIR, default ${TMPDIR:-/tmp}/posttrain_tiny_cpu), points MODEL_PATH, DATA_DIR and
# REWARD_MODEL_PATH at them, and fills TINY_ARGS: the overrides, appended after a real script's own keys, that make
# its run small — 2 steps of 4 prompts (times the script's rollout.n) with 16-token responses, in fp32 on the CPU,
# validation on the tiny test sets at the end, the run folder under $TINY_RUN_ROOT (default
# $POSTTRAIN_TINY_DIR/runs)/<folder>/<twin name>, replaced on every run.
EXAMPLES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TINY_DIR=${POSTTRAIN_TINY_DIR:-${TMPDIR:-/tmp}/posttrain_tiny_cpu}
if [ ! -d "$TINY_DIR/data/search_qa" ]; then  # the last folder build.py writes
  "${PYTHON:-python3}" "$EXAMPLES_DIR/tiny_cpu/build.py" "$TINY_DIR" >/dev/null
fi
export MODEL_PATH="$TINY_DIR/model" DATA_DIR="$TINY_DIR/data" REWARD_MODEL_PATH="$TINY_DIR/reward_model"
export HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # a tiny model runs fastest on one thread a process
TINY_RUN_DIR="${TINY_RUN_ROOT:-$TINY_DIR/runs}/$(basename "$(cd "$(dirname "$0")" && pwd)")/$(basename "$0" .sh)"
TINY_ARGS=(
  data.train_batch_size=4
  data.max_prompt_length=256
  data.max_response_length=16
  actor_rollout_ref.model.dtype=fp32
  actor_rollout_ref.rollout.dtype=fp32
  actor_rollout_ref.actor.ppo_mini_batch_size=2
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
  trainer.total_epochs=1
  trainer.total_training_steps=2
  trainer.val_before_train=False
  trainer.test_freq=2
  trainer.save_freq=-1
  "trainer.logger=['console']"
  trainer.device=cpu
  trainer.default_local_dir="$TINY_RUN_DIR"
  trainer.resume_mode=disable
  trainer.overwrite_run_dir=True
)
# a free local port, for the scripts that start torchrun
free_port() {
  "${PYTHON:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
