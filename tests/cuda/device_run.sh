#!/usr/bin/env bash
# One call on a CUDA machine (the H200 of the device tool): build _core and _cuda, run the CUDA
# tests, compute-sanitizer over a short parity run, the handshake probe and benchmarks/cuda.py.
# Logs go to $OUT (or /tmp/strata-cuda-out). Every step is bounded by `timeout`.
#   tests/cuda/device_run.sh [all|tests|sanitize|bench]
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
out=${OUT:-/tmp/strata-cuda-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 CXX=${CXX_FOR_STRATA:-/usr/bin/g++} CUDAHOSTCXX=/usr/bin/g++
py=python3
step() {  # step NAME SECONDS CMD...: runs CMD under timeout, log in $out/NAME.log
  local name=$1 secs=$2
  shift 2
  echo "== $name"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "rc($name)=$rc in $((SECONDS - t0)) s"
  return $rc
}
nvidia-smi -L
# Carried wheels (pybind11 >= 3 for native_enum, which the image may lack): .whl in the
# repository root, or beside it when this tree was copied into a folder of another checkout.
for whl in .whl ../.whl; do
  if ls "$whl"/*.whl > /dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$whl"/*.whl
    export PYTHONPATH=/tmp/site
    break
  fi
done
# One build folder per source tree: several trees share a warm machine (CMake refuses a cache
# made from another source directory).
build=${STRATA_BUILD_DIR:-/tmp/strata-build-$(printf %s "$PWD" | md5sum | cut -c1-8)}
step build 240 bash -c "cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSTRATA_BUILD_PYTHON=ON -DSTRATA_CUDA=ON -DPython_EXECUTABLE=\$(command -v $py) \
  -Dpybind11_DIR=\$($py -m pybind11 --cmakedir) && cmake --build $build -j16 --target _core _cuda strata_cuda_check" \
  || exit 1
cp "$build"/_core*.so "$build"/_cuda*.so src/strata_stream/
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
$py -c "import strata_stream._cuda as c; print('cuda:', c.unavailable() or 'available')"
if [ "$what" = all ] || [ "$what" = tests ]; then
  $py - <<'PY'
import numpy as np
from strata_stream.pack import Geometry, write_pack
g = Geometry(2, 8, 2, 256, 128, "softmax_topk", True)
rng = np.random.default_rng(0)
write_pack("/tmp/check.strpk", g, [rng.standard_normal((8, 256)).astype(np.float32)] * 2,
           lambda l, e: tuple(rng.standard_normal(s).astype(np.float32) / 8
                              for s in ((128, 256), (128, 256), (256, 128))),
           weight_format="q4", group_size=64, scale_dtype="bf16", progress=False)
PY
  step backend_check 60 "$build/strata_cuda_check" /tmp/check.strpk
  step tests 300 $py -m pytest -q -p no:cacheprovider -m cuda tests/cuda
  step probe_build 60 nvcc -O2 -arch=sm_90 -o /tmp/probe \
    benchmarks/native/cuda_handshake_probe.cu -lcuda && step probe 30 /tmp/probe
  step window_selection 120 $py -m pytest -q -p no:cacheprovider tests/test_window.py \
    -k "backend_selection" tests/cuda -m "not cuda"
fi
if [ "$what" = all ] || [ "$what" = sanitize ]; then
  for tool in memcheck racecheck; do
    step "sanitize_$tool" 120 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --target-processes all $py -m pytest -q -p no:cacheprovider -m cuda \
      tests/cuda/test_cuda_backend.py -k "odd_widths or (routed_calls and mxfp4)"
  done
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  STRATA_CUDA_TRACE=1 step bench 200 $py benchmarks/cuda.py --layers 2 --experts 16 --decode --json "$out/cuda_bench.json"
fi
