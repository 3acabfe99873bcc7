#!/bin/bash
# One device call (the `device` tool): install the slimmed onnxruntime-gpu carried in .gpu
# (benchmarks/device/slim_onnxruntime.py), check that CUDA works, then run "$@" (default: the
# CUDA tests and bench_gpu with the CUDA graph variants), writing logs into $OUT.
#   copy this file to .gpu/run.sh; run: bash .gpu/run.sh [command...]   (carry: [".gpu"])
set -u
export PYTHONUNBUFFERED=1 CUDA_MODULE_LOADING=LAZY
mkdir -p /tmp/site && python3 -c "import tarfile; tarfile.open('.gpu/onnxruntime.tar.xz').extractall('/tmp/site')" || exit 3
export PYTHONPATH=/tmp/site
# the CUDA 13, cuBLAS and cuDNN libraries of the image's torch (nvidia-* wheels)
export LD_LIBRARY_PATH=$(python3 -c "
import glob, os, site
d = sorted({os.path.dirname(p) for sp in site.getsitepackages()
            for p in glob.glob(os.path.join(sp, 'nvidia', '**', 'lib*.so*'), recursive=True)})
print(':'.join(d))"):${LD_LIBRARY_PATH:-}
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.txt 2>&1
python3 -c "from kfac_compiler.runtime.device import cuda_status; print('cuda_status', cuda_status())" \
  | tee $OUT/env.txt
grep -q "cuda_status (True" $OUT/env.txt || exit 4
if [ $# -gt 0 ]; then "$@"; exit; fi
timeout 150 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rs tests/test_cuda.py 2>&1 | tail -30 | tee $OUT/test_cuda.log
timeout 300 python3 benchmarks/bench_gpu.py --models resnet18,gpt --steps 20 --target-steps 150 --peers \
  --kfac-variant static_steps=1 --kfac-variant cuda_graphs=1 --adam-variant cuda_graphs=1 --out $OUT 2>&1 \
  | grep -v -i warn | tee $OUT/bench.log
# where ResNet-18's default K-FAC step (82.9 ms on the H200 on 2026-11-30, 28.5 on an H100 on
# 2026-11-24) spends its time: each session's slowest op types and its CPU-placed nodes
timeout 120 python3 benchmarks/bench_gpu.py --models resnet18 --steps 10 --target-steps 0 --residency \
  --out - 2>&1 | grep -v -i warn | tee $OUT/residency.log
