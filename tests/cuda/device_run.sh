#!/usr/bin/env bash
# One call on a CUDA machine (the H200 of the device tool): build _core and _cuda, run the CUDA
# tests, compute-sanitizer over a short parity run, the handshake probe and benchmarks/cuda.py.
# Logs go to $OUT (or /tmp/strata-cuda-out). Every step is bounded by `timeout`.
#   tests/cuda/device_run.sh [all | tests sanitize kernels bench prompt ...]
# kernels: benchmarks/native/cuda_kernel_bench.cu (the decode kernels alone, CUDA events) and ncu
# over it; with STRATA_KERNELS_BEFORE=DIR (a folder holding another commit's kernels/), the same
# for those kernels, and their outputs compared bitwise.
# prompt: benchmarks/cuda_prompt.py (the bf16 tensor-core kernels against torch._grouped_mm, and
# against STRATA_KERNELS_BEFORE's kernels where given).
set -uo pipefail
cd "$(dirname "$0")/../.."
what=" ${*:-all} "
wants() { [[ "$what" == *" all "* || "$what" == *" $1 "* ]]; }
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
# The kernels alone first: they need no Python build.
# -D flags for the kernels' compile-time tuning knobs, for the build: STRATA_CUDA_TUNING, or
# chosen below (and kept in /tmp/strata-cuda-tuning for a later call of this script).
tuning=${STRATA_CUDA_TUNING:-}
# Hopper's own code (the bf16 kernels use wgmma: csrc/cuda/cuda.cmake builds the same).
arch="-gencode=arch=compute_90a,code=sm_90a"
if wants kernels; then
  # Built in parallel: now, before (STRATA_KERNELS_BEFORE), and tunings of the compile-time
  # knobs: the route kernel's experts per block (r*), the decode kernels' output rows per warp
  # (down: d*; gate_up's 2 rows spill) and per-chunk scale loads instead of shared scales (dps),
  # and a build without programmatic dependent launch (nopdl: for comparison, never chosen). Every
  # build's outputs are compared with before's, bitwise; the fastest route (route_xs) and the
  # fastest decode expert launches (experts_seq: gate_up, down and combine back to back) then
  # become the build's flags.
  kb_build() {  # kb_build NAME DIR [nvcc flags]
    local name=$1 dir=$2
    shift 2
    echo "$*" > "/tmp/kbench_$name.flags"
    local mma=()  # the tensor-core kernels, in trees that have them
    [ -f "$dir/kernels/mma_experts.cu" ] && mma=("$dir/kernels/mma_experts.cu")
    nvcc -std=c++20 -O3 $arch "$@" -I"$dir" -Icsrc/engine -o "/tmp/kbench_$name" \
      benchmarks/native/cuda_kernel_bench.cu "$dir/kernels/route.cu" "$dir/kernels/experts.cu" \
      "${mma[@]}" > "$out/kbench_build_$name.log" 2>&1 || echo "kbench build $name failed"
  }
  R=-DSTRATA_CUDA_ROUTE_LOGITS D=-DSTRATA_CUDA_DOWN_DECODE_ROWS
  [ -n "${STRATA_KERNELS_BEFORE:-}" ] && kb_build before "$STRATA_KERNELS_BEFORE" &
  kb_build now csrc/cuda &
  kb_build r8 csrc/cuda $R=8 &
  kb_build r16 csrc/cuda $R=16 &
  kb_build d2 csrc/cuda $D=2 &
  kb_build d1 csrc/cuda $D=1 &
  kb_build dps csrc/cuda -DSTRATA_CUDA_DECODE_SHARED_SCALES=0 &
  kb_build nopdl csrc/cuda -DSTRATA_CUDA_PDL=0 &
  wait
  names="before now r8 r16 d2 d1 dps nopdl"
  for name in $names; do
    [ -x "/tmp/kbench_$name" ] || continue
    step "kbench_$name" 60 "/tmp/kbench_$name" --dump "/tmp/kbench_$name.bin" \
      --json "$out/kbench_$name.json"
    [ "$name" != before ] && [ -f /tmp/kbench_before.bin ] && \
      { cmp /tmp/kbench_before.bin "/tmp/kbench_$name.bin" && echo "$name: bitwise equal to before"; }
  done
  tuning=$($py - "$out" $names <<'PY'
import re
import sys

out, names = sys.argv[1], sys.argv[2:]
t = {}
for name in names:
    try:
        log = open(f"{out}/kbench_{name}.log").read()
        flags = open(f"/tmp/kbench_{name}.flags").read().split()
    except OSError:
        continue
    us = {m[0]: float(m[1]) for m in re.findall(r"^(\w+)\s+([\d.]+) us", log, re.M)}
    if name != "before" and "route_xs" in us and "bitwise equal" in log:
        t[name] = (us, flags)
if "now" in t:
    route = min((n for n in t if n == "now" or n.startswith("r")), key=lambda n: t[n][0]["route_xs"])
    dec = min((n for n in t if n == "now" or n.startswith("d")),
              key=lambda n: t[n][0].get("experts_seq", t[n][0]["gate_up"] + t[n][0]["down"]))
    print(" ".join([f for f in t[route][1] if "ROUTE" in f] + [f for f in t[dec][1] if "DECODE" in f]))
PY
)
  echo "tuning chosen: '${tuning}'"
  echo "$tuning" > /tmp/strata-cuda-tuning
  for name in before now; do  # ncu: 2 launches of route, then gate_up and down
    [ -x "/tmp/kbench_$name" ] || continue
    step "ncu_$name" 120 ncu --clock-control none -k regex:"route_kernel|decode_kernel|direct" \
      --launch-skip 404 --launch-count 4 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      "/tmp/kbench_$name"
  done
  if [ -n "$tuning" ]; then
    # shellcheck disable=SC2086
    kb_build tuned csrc/cuda $tuning
    step kbench_tuned 60 /tmp/kbench_tuned --dump /tmp/kbench_tuned.bin --json "$out/kbench_tuned.json"
    cmp /tmp/kbench_before.bin /tmp/kbench_tuned.bin && echo "tuned: bitwise equal to before"
    step ncu_tuned 120 ncu --clock-control none \
      -k regex:"route_kernel|decode_kernel|direct" --launch-skip 404 --launch-count 4 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      /tmp/kbench_tuned
  fi
fi
# One build folder per source tree: several trees share a warm machine (CMake refuses a cache
# made from another source directory).
build=${STRATA_BUILD_DIR:-/tmp/strata-build-$(printf %s "$PWD" | md5sum | cut -c1-8)}
build_cmd="cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSTRATA_BUILD_PYTHON=ON -DSTRATA_CUDA=ON -DPython_EXECUTABLE=\$(command -v $py) \
  -Dpybind11_DIR=\$($py -m pybind11 --cmakedir) -DCMAKE_CUDA_FLAGS='$tuning' && cmake --build $build -j16 --target _core _cuda _bench strata_cuda_check"
# The bf16 tensor-core kernels against torch: no Python build either.
if wants prompt; then
  # The build (whose flags no prompt step changes) compiles beside the bench's libraries, and
  # is finished before anything is timed; the build step below then finds it up to date.
  timeout 240 bash -c "$build_cmd" > "$out/build_early.log" 2>&1 &
  # Each tree's experts.cu and the bench compile once; each build of mma_experts.cu (the
  # knobs' neighbours, one piece) links against them.
  pb_common() {  # pb_common NAME DIR: the objects every build of DIR's kernels shares
    local name=$1 dir=$2
    nvcc -std=c++20 -O3 $arch -Xcompiler -fPIC -I"$dir" -Icsrc/engine -c \
      -o "/tmp/pb_bench_$name.o" benchmarks/native/cuda_prompt_bench.cu \
      > "$out/prompt_build_${name}_bench.log" 2>&1 &
    nvcc -std=c++20 -O3 $arch -Xcompiler -fPIC -I"$dir" -Icsrc/engine -c \
      -o "/tmp/pb_experts_$name.o" "$dir/kernels/experts.cu" \
      > "$out/prompt_build_${name}_experts.log" 2>&1 &
    wait
  }
  pb_mma() {  # pb_mma NAME DIR [nvcc flags]: DIR's mma_experts.cu with the flags
    local name=$1 dir=$2
    shift 2
    nvcc -std=c++20 -O3 $arch -Xcompiler -fPIC "$@" -I"$dir" -Icsrc/engine -c \
      -o "/tmp/pb_mma_$name.o" "$dir/kernels/mma_experts.cu" \
      > "$out/prompt_build_$name.log" 2>&1 || echo "prompt bench build $name failed"
  }
  pb_link() {  # pb_link NAME TREE: /tmp/libprompt_NAME.so from TREE's shared objects
    nvcc $arch -shared -o "/tmp/libprompt_$1.so" "/tmp/pb_bench_$2.o" "/tmp/pb_experts_$2.o" \
      "/tmp/pb_mma_$1.o" >> "$out/prompt_build_$1.log" 2>&1 || echo "prompt bench link $1 failed"
  }
  # Neighbours of the tensor-core kernels' tuning knobs (mma_experts.cu): timed beside the
  # defaults and checked bitwise against them; the defaults change by hand, from these figures.
  M=-DSTRATA_CUDA_MMA
  # sw1: the small tiling with one warpgroup (64 output rows, the first default); sb1024: the
  # small tiling below 1024 rows (512 too); pt32: the large tiling's gate_up with chunks of 32
  # tokens; walk: the work items found by the walk over the group counts, not the table
  # (checked bitwise). (Chunks of 64 tokens in the large gate_up, or of 96 or 128 in its down,
  # spill registers: not built.)
  variants=("sw1:${M}_SMALL_WARPGROUPS=1" "sb1024:${M}_SMALL_BELOW_ROWS=1024"
            "pt32:${M}_PROMPT_TOKENS=32" "walk:${M}_TABLE_GROUPS=4")
  # Another list: STRATA_PROMPT_VARIANTS="NAME:FLAGS ..." (nofence:-DSTRATA_CUDA_MMA_NO_PROXY_
  # FENCE_BENCH times the proxy fence's cost; bench only).
  [ -n "${STRATA_PROMPT_VARIANTS+x}" ] && read -r -a variants <<< "$STRATA_PROMPT_VARIANTS"
  pb_common now csrc/cuda &
  [ -n "${STRATA_KERNELS_BEFORE:-}" ] && pb_common before "$STRATA_KERNELS_BEFORE" &
  pb_mma now csrc/cuda &
  pb_mma one_piece csrc/cuda -DSTRATA_CUDA_MMA_ONE_PIECE_BENCH &
  if [ -n "${STRATA_KERNELS_BEFORE:-}" ]; then
    if [ -f "$STRATA_KERNELS_BEFORE/kernels/mma_experts.cu" ]; then
      pb_mma before "$STRATA_KERNELS_BEFORE" &
    else  # a tree without the tensor-core kernels: an empty object
      echo > /tmp/pb_empty.cu && nvcc $arch -Xcompiler -fPIC -c -o /tmp/pb_mma_before.o /tmp/pb_empty.cu &
    fi
  fi
  for v in "${variants[@]}"; do
    # shellcheck disable=SC2086
    pb_mma "${v%%:*}" csrc/cuda ${v#*:} &
  done
  wait
  pb_link now now
  pb_link one_piece now
  [ -n "${STRATA_KERNELS_BEFORE:-}" ] && pb_link before before
  for v in "${variants[@]}"; do pb_link "${v%%:*}" now; done
  extra=()
  [ -f /tmp/libprompt_before.so ] && extra=(--lib-before /tmp/libprompt_before.so)
  for v in "${variants[@]}"; do
    [ -f "/tmp/libprompt_${v%%:*}.so" ] && extra+=(--lib-variant "${v%%:*}=/tmp/libprompt_${v%%:*}.so")
  done
  step prompt 300 $py benchmarks/cuda_prompt.py --lib-now /tmp/libprompt_now.so \
    --lib-one-piece /tmp/libprompt_one_piece.so "${extra[@]}" --json "$out/cuda_prompt.json"
  # Where the tensor-core kernels stall: ncu's full set over the first gate_up and down of a
  # 128-row and of a 2048-row random wave (STRATA_PROMPT_NCU=0 skips it).
  if [ "${STRATA_PROMPT_NCU:-1}" != 0 ]; then
    for r in 128 2048; do
      step "ncu_prompt_$r" 120 ncu --set full -k regex:mma_kernel --launch-count 2 \
        --import-source no -o "/tmp/ncu_prompt_$r" -f $py benchmarks/cuda_prompt.py \
        --lib-now /tmp/libprompt_now.so --rows "$r" --reps 1
      timeout 60 ncu -i "/tmp/ncu_prompt_$r.ncu-rep" --page details > "$out/ncu_prompt_$r.txt" 2>&1
      # The stall reasons, cycles a warp waited per issued instruction, by reason.
      timeout 60 ncu -i "/tmp/ncu_prompt_$r.ncu-rep" --page raw 2>&1 \
        | grep -E "issue_stalled_[a-z_]+_per_issue_active.ratio|Function Name|^  [a-z_]+mma" \
        > "$out/ncu_prompt_stalls_$r.txt"
      awk '$NF + 0 >= 0.2 || /mma/' "$out/ncu_prompt_stalls_$r.txt" | head -40
      grep -E "^  [a-z_]|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issued Warp|Stall|Block Limit" \
        "$out/ncu_prompt_$r.txt" | head -60
    done
  fi
fi

step build 240 bash -c "$build_cmd" || exit 1
cp "$build"/_core*.so "$build"/_cuda*.so "$build"/_bench*.so src/strata_stream/
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
$py -c "import strata_stream._cuda as c; print('cuda:', c.unavailable() or 'available')"
if wants tests; then
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
if wants sanitize; then
  for tool in memcheck racecheck; do
    step "sanitize_$tool" 120 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --target-processes all $py -m pytest -q -p no:cacheprovider -m cuda \
      tests/cuda/test_cuda_backend.py tests/cuda/test_cuda_kernels.py \
      -k "odd_widths or (routed_calls and mxfp4) or (many_experts and q4) or (same_bits and bf16)"
  done
fi
if wants bench; then
  step io_ref_build 60 nvcc -O2 -std=c++17 -o /tmp/io_ref benchmarks/native/cuda_io_reference.cu
  STRATA_CUDA_TRACE=1 step bench 240 $py benchmarks/cuda.py --layers 2 --experts 16 --decode \
    --backends ${STRATA_BENCH_BACKENDS:-cpu cuda-device cuda-mapped} \
    --io-reference /tmp/io_ref --json "$out/cuda_bench.json"
  # A decode layer with all of Qwen3-30B-A3B's 128 experts (the route kernel's real width).
  step bench128 120 $py benchmarks/cuda.py --layers 1 --experts 128 --prompt-rows \
    --backends cuda-device --json "$out/cuda_bench128.json"
fi
