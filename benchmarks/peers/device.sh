#!/usr/bin/env bash
# The peer comparison's GPU rows on a CUDA machine (the device tool's H100/H200), in two calls
# that each fit well inside a 10-minute command:
#   benchmarks/peers/device.sh prepare   # builds and files (each skipped where it exists)
#   benchmarks/peers/device.sh run       # the interleaved runs: JSON, PNG and logs into $OUT;
#                                        # again on the same machine to finish what one call
#                                        # left (each call stops starting runs after a budget)
#   benchmarks/peers/device.sh all       # both, where one command may run longer
# The trimmed llama.cpp source must travel with the tree: `python benchmarks/peers/llama_trim.py`
# writes .peers-src/llama.cpp-trim.tar.xz (ignored by git: name .peers-src in the call's carry).
# A pybind11 >= 3 wheel in .whl/ (carried too) is installed first, as tests/cuda/device_run.sh
# does. Settings: PEERS_LAYERS (4), PEERS_PAIRS (2), PEERS_WORK (/tmp/peers-gpu: a warm machine
# keeps it, so a second call finds the first one's files), PEERS_JOBS (the llama.cpp build's
# parallel jobs; default the core count less 4, which the strata-stream build beside it takes),
# PEERS_RUN_ARGS (more arguments to `gpu_rows.py run`), PEERS_RUN_BUDGET_S (450: seconds after
# which a run call starts no more runs), PEERS_FLASH_ATTN=1 (build and run
# llama.cpp with its CUDA flash-attention kernels: a longer build). Every step is bounded by
# `timeout` and its output is kept in $OUT/NAME.log (or /tmp/peers-gpu-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-}
case "$what" in
  prepare | run | all) ;;
  *) echo "usage: benchmarks/peers/device.sh prepare|run|all"; exit 2 ;;
esac
out=${OUT:-/tmp/peers-gpu-out}
work=${PEERS_WORK:-/tmp/peers-gpu}
layers=${PEERS_LAYERS:-4}
pairs=${PEERS_PAIRS:-2}
cores=$(nproc)
jobs=${PEERS_JOBS:-$((cores > 8 ? cores - 4 : cores))}
fa=()
[ "${PEERS_FLASH_ATTN:-0}" = 1 ] && fa=(--flash-attn)
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 CXX=${CXX_FOR_STRATA:-/usr/bin/g++} CUDAHOSTCXX=/usr/bin/g++
py=python3
step() {  # step NAME SECONDS CMD...: CMD under timeout, its output shown and kept in $out/NAME.log
  local name=$1 secs=$2
  shift 2
  echo "== $name ($(date -u +%T))"
  local t0=$SECONDS
  timeout "$secs" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "rc($name)=$rc in $((SECONDS - t0)) s"
  return "$rc"
}
for whl in .whl ../.whl; do
  if ls "$whl"/*.whl > /dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"/*.whl
    export PYTHONPATH=/tmp/site
    break
  fi
done
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
rows=(--workdir "$work" --layers "$layers" "${fa[@]}")

if [ "$what" = prepare ] || [ "$what" = all ]; then
  {
    nvidia-smi -L
    $py -c "import torch, transformers, accelerate; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
    echo "cores $cores, llama.cpp jobs $jobs"; df -h "$work" | tail -1; free -g | head -2
    ls -la .peers-src/
  } 2>&1 | tee "$out/machine.log"
  [ -f .peers-src/llama.cpp-trim.tar.xz ] || { echo "no .peers-src/llama.cpp-trim.tar.xz: \
run benchmarks/peers/llama_trim.py and carry .peers-src"; exit 2; }
  # strata-stream's extension (_core and _cuda: what the pack and the CUDA rows need) and then its
  # pack, once the checkpoint is written, beside llama.cpp's build and the GGUF conversion; an
  # up-to-date build folder (a warm machine) makes the build a no-op.
  build=${STRATA_BUILD_DIR:-/tmp/strata-build-$(printf %s "$PWD" | md5sum | cut -c1-8)}
  ckpt="$work/qwen3-30b-a3b-shapes-${layers}l/.complete"
  (
    step strata_build 300 bash -c "cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DSTRATA_BUILD_PYTHON=ON -DSTRATA_CUDA=ON -DPython_EXECUTABLE=$(command -v $py) \
      -Dpybind11_DIR=$($py -m pybind11 --cmakedir) && \
      cmake --build $build -j 4 --target _core _cuda && \
      cp $build/_core*.so $build/_cuda*.so src/strata_stream/" || exit 1
    timeout 400 bash -c "until [ -f $ckpt ]; do sleep 5; done" || exit 1
    step pack 300 $py benchmarks/peers/gpu_rows.py prepare "${rows[@]}" --steps pack
  ) > "$out/strata_side.log" 2>&1 &
  strata=$!
  step prepare 540 $py benchmarks/peers/gpu_rows.py prepare "${rows[@]}" --jobs "$jobs" \
    --steps source llama checkpoint gguf driver
  prepared=$?
  wait "$strata"
  built=$?
  cat "$out/strata_side.log" | grep -E "^(==|rc\()"
  tail -n 5 "$out/pack.log" 2> /dev/null
  cp "$work/prepare_times.json" "$out/" 2> /dev/null
  tail -n 40 "$work/logs/llama_build.log" > "$out/llama_build_tail.log" 2> /dev/null
  [ "$prepared" = 0 ] && [ "$built" = 0 ] || exit 1
fi

if [ "$what" = run ] || [ "$what" = all ]; then
  ls src/strata_stream/_cuda*.so > /dev/null 2>&1 \
    || { echo "strata_stream._cuda is not built: run the prepare call first"; exit 2; }
  # The JSON stays in $work: a later `run` call on the same (warm) machine resumes it, doing only
  # the runs still missing; each call starts no run after PEERS_RUN_BUDGET_S seconds.
  # shellcheck disable=SC2086
  step run 570 $py benchmarks/peers/gpu_rows.py run "${rows[@]}" --pairs "$pairs" --resume \
    --budget-s "${PEERS_RUN_BUDGET_S:-450}" --timeout 110 --json "$work/peers_gpu.json" \
    --plot "$out/peers_gpu.png" ${PEERS_RUN_ARGS:-}
  rc=$?
  cp "$work/peers_gpu.json" "$out/" 2> /dev/null
  tar -czf "$out/gpu_run_logs.tar.gz" -C "$work" logs 2> /dev/null
  exit "$rc"
fi
