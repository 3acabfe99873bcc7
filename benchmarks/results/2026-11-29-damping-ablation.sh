#!/usr/bin/env bash
# The damping/guard ablation of 2026-11-29-damping-ablation.md, one knob at a time.
#   bash benchmarks/results/2026-11-29-damping-ablation.sh suite NAME...   digits, zoo, LeNet-5 (seed 0)
#   bash benchmarks/results/2026-11-29-damping-ablation.sh gpt NAME...     the byte-level GPT (seed 0, 600 steps)
# NAME: one of the configurations below; results under $OUT (default /tmp/damp)/NAME/. Tuned
# Adam's targets are cached in $OUT/adam_*.json (the first run computes them; LeNet-5's were
# taken from 2026-11-28-to-target-mnist.json, the same Adam runs).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/damp}
# the runs were made with the defaults of then (loss_spike_factor 10), pinned here since the
# default is 3 now; "def" is those defaults, each other row changes one knob from them
declare -A KNOBS=(
  [def]='{"loss_spike_factor": 10.0}'
  [md1e-3]='{"min_damping": 0.001, "loss_spike_factor": 10.0}'
  [md3e-3]='{"min_damping": 0.003, "damping": 0.003, "loss_spike_factor": 10.0}'
  [md1e-2]='{"min_damping": 0.01, "damping": 0.01, "loss_spike_factor": 10.0}'
  [spike3]='{"loss_spike_factor": 3.0}'
)
lane=$1; shift
for name in "$@"; do
  k=${KNOBS[$name]}; d=$OUT/$name; mkdir -p "$d"
  if [ "$lane" = suite ]; then
    timeout 1500 python benchmarks/bench_to_target.py digits --interleaved-rounds 0 --knobs "$k" \
      --adam-cache "$OUT/adam_digits.json" --out "$d" > "$d/digits.log" 2>&1
    timeout 2400 python benchmarks/bench_to_target.py zoo --steps 500 --models small_cnn,depthwise_cnn,transformer_block \
      --knobs "$k" --adam-cache "$OUT/adam_zoo.json" --out "$d" > "$d/zoo.log" 2>&1
    timeout 2400 python benchmarks/bench_to_target.py mnist --seeds 1 --knobs "$k" \
      --adam-cache "$OUT/adam_mnist.json" --out "$d" > "$d/mnist.log" 2>&1
  else
    timeout 3600 python benchmarks/results/2026-11-28-gpt-spikes.py "$k" "$d/gpt.json" > "$d/gpt.log" 2>&1
  fi
done
