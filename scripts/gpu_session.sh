#!/usr/bin/env bash
# A lent GPU session runs `python scripts/gpu_check.py` first: every figure that matters in
# one time-boxed command (480 s), with three tile configurations per kernel.  The stages
# below are the long form, tuning sweeps over every candidate tile, for a longer lease; each
# fits a 10-minute call (run from the repository root; results and logs go to $OUT):
#
#   bash scripts/gpu_session.sh check      # versions, then the kernel tests on the GPU
#   bash scripts/gpu_session.sh kernels    # tune + time the Pallas kernels (bench_kernels --tune)
#   bash scripts/gpu_session.sh train      # ResNet-50 step: auto vs xla, each with both
#                                          # BatchNorm backwards; torch.compile, Flax
#   bash scripts/gpu_session.sh profile    # where the ResNet-50 step's device time goes
#   bash scripts/gpu_session.sh mgpu       # Hopper only: tune the Mosaic GPU conv's tiles
#                                          # (forward, both gradients) and race, then time
#                                          # it against Triton and cuDNN (bench_mgpu --tune)
#   bash scripts/gpu_session.sh fused      # Hopper only: BatchNorm fused into the Mosaic conv
#                                          # (statistics epilogue, BN+ReLU prologue): tune its
#                                          # tiles, then time it against the unfused chains
#                                          # (bench_mgpu --fused --tune: the verdicts
#                                          # Choices(conv_bn="auto") reads)
#   bash scripts/gpu_session.sh train_fused  # ResNet-50 step, conv_bn=off vs mosaic
#   bash scripts/gpu_session.sh mgpu_window  # Hopper only: tune the Mosaic GPU pooling and
#                                          # depthwise kernels' tiles and races, then time
#                                          # them against Triton and XLA
#                                          # (bench_mgpu_window --tune)
#
# Extra arguments go to the stage's script (e.g. `kernels --groups pool,mobilenet`).
# `kernels`, `mgpu`, `fused` and `mgpu_window` tune only shapes not yet in
# $OUT/autotune.json, so when a call runs out of time, the next one resumes: bring the file
# back into the tree and pass it as RESUME_CACHE=path (copied to $OUT/autotune.json when
# that does not exist yet).
# Candidates compile on up to 8 threads ($JAXCNN_AUTOTUNE_COMPILE_THREADS).
# The tuner's choices land in $OUT/autotune.json; `train` and `profile` read that file
# when it exists, so run `kernels` first in the same call or bring the file back.
# Copying it over pallas_kernels/tuned.json ships the measurements.
set -euo pipefail
stage=${1:?usage: gpu_session.sh check|kernels|train|profile|mgpu|fused|train_fused|mgpu_window [args...]}
shift
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAXCNN_AUTOTUNE_CACHE=$OUT/autotune.json
if [ -n "${RESUME_CACHE:-}" ] && [ ! -f "$JAXCNN_AUTOTUNE_CACHE" ]; then
  cp "$RESUME_CACHE" "$JAXCNN_AUTOTUNE_CACHE"
fi
log() { tee -a "$OUT/$stage.log"; }

case $stage in
  check)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
      python3 -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())'
      python3 -c 'import triton; print("triton", triton.__version__)' || true
    } 2>&1 | log
    python3 -m pytest -q -p no:cacheprovider tests/pallas "$@" 2>&1 | tail -n 30 | log ;;
  kernels)
    python3 scripts/bench_kernels.py --tune --repeats 10 --json "$OUT/kernels.json" "$@" 2>&1 | log ;;
  train)
    python3 scripts/bench_train.py --models resnet50 --impls auto,xla \
      --bn-grads autodiff,closed_form --frameworks jaxcnn,torch_compile,flax \
      --steps 5 --reps 7 --json "$OUT/train.json" "$@" 2>&1 | log ;;
  profile)
    python3 scripts/profile_step.py --out "$OUT/profile" "$@" 2>&1 | log ;;
  mgpu)
    python3 scripts/bench_mgpu.py --tune --repeats 10 --json "$OUT/mgpu.json" "$@" \
      2>&1 | log ;;
  fused)
    python3 scripts/bench_mgpu.py --fused --tune --repeats 10 --json "$OUT/mgpu_fused.json" \
      "$@" 2>&1 | log ;;
  train_fused)
    python3 scripts/bench_train.py --models resnet50 --impls auto --conv-bn off,mosaic \
      --frameworks jaxcnn --steps 5 --reps 5 --json "$OUT/train_fused.json" "$@" 2>&1 | log ;;
  mgpu_window)
    python3 scripts/bench_mgpu_window.py --tune --repeats 10 --json "$OUT/mgpu_window.json" \
      "$@" 2>&1 | log ;;
  *)
    echo "gpu_session.sh: unknown stage '$stage' (check, kernels, train, profile, mgpu," \
      "fused, train_fused, mgpu_window)" >&2
    exit 2 ;;
esac
