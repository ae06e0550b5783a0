#!/usr/bin/env bash
# One call on a CUDA machine (the H200 of the device tool): build _core and _cuda, run the CUDA
# tests, compute-sanitizer over a short parity run, the handshake probe and benchmarks/cuda.py.
# Logs go to $OUT (or /tmp/strata-cuda-out). Every step is bounded by `timeout`.
#   tests/cuda/device_run.sh [all | tests sanitize kernels bench prompt io ...]
# kernels: benchmarks/native/cuda_kernel_bench.cu (the decode kernels alone, CUDA events) and ncu
# over it; with STRATA_KERNELS_BEFORE=DIR (a folder holding another commit's kernels/), the same
# for those kernels, and their outputs compared bitwise.
# prompt: benchmarks/cuda_prompt.py (the bf16 tensor-core kernels against torch._grouped_mm, and
# against STRATA_KERNELS_BEFORE's kernels where given).
# io (not part of all): IO threads swept over the IO path, a miss and decode (the end of the file).
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
# wgmma_object NAME DIR [nvcc flags]: DIR's wgmma kernels (trees that have them), which exist in
# sm_90a code alone, as /tmp/wgmma_NAME.o for a bench build to link; false where DIR has none.
wgmma_object() {
  local name=$1 dir=$2
  shift 2
  [ -f "$dir/kernels/wgmma_experts.cu" ] || return 1
  nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC "$@" -I"$dir" \
    -Icsrc/engine -c -o "/tmp/wgmma_$name.o" "$dir/kernels/wgmma_experts.cu" \
    > "$out/${name}_wgmma_build.log" 2>&1
}
if wants kernels; then
  # Built in parallel: now, before (STRATA_KERNELS_BEFORE), and variants of the compile-time
  # knobs: the route kernel's experts per block (r8, r2), output rows per warp (down: d*;
  # gate_up on the lean path: dg1), per-chunk scale loads instead of shared scales (dps) and the
  # lean down at the general rule's 3 blocks a multiprocessor (db3). Every build's outputs
  # are compared with before's, bitwise; the fastest route (route_gpu, else route_xs) and the
  # fastest decode expert launches (experts_gpu, else experts_seq: gate_up, down and combine
  # back to back; *_gpu: the GPU's time alone) among the bitwise-equal builds then become the
  # build's flags. STRATA_KERNELS_VARIANTS (names) narrows the variants; STRATA_KERNELS_NCU=0
  # skips ncu.
  kb_build() {  # kb_build NAME DIR [nvcc flags]
    local name=$1 dir=$2
    shift 2
    echo "$*" > "/tmp/kbench_$name.flags"
    local mma=()  # the tensor-core kernels, in trees that have them
    [ -f "$dir/kernels/mma_experts.cu" ] && mma=("$dir/kernels/mma_experts.cu")
    wgmma_object "kbench_$name" "$dir" "$@" && mma+=("/tmp/wgmma_kbench_$name.o")
    nvcc -std=c++20 -O3 -arch=sm_90 -Xptxas -warn-spills "$@" -I"$dir" -Icsrc/engine -o "/tmp/kbench_$name" \
      benchmarks/native/cuda_kernel_bench.cu "$dir/kernels/route.cu" "$dir/kernels/experts.cu" \
      "${mma[@]}" >> "$out/kbench_build_$name.log" 2>&1 || echo "kbench build $name failed"
  }
  R=-DSTRATA_CUDA_ROUTE D=-DSTRATA_CUDA_DOWN_DECODE_ROWS
  kvariants=("r8:${R}_LOGITS=8" "r2:${R}_LOGITS=2"
             "d2:$D=2" "d8:$D=8" "dg1:-DSTRATA_CUDA_GATE_UP_DECODE_LEAN_ROWS=1"
             "dps:-DSTRATA_CUDA_DECODE_SHARED_SCALES=0" "db3:-DSTRATA_CUDA_DOWN_DECODE_MIN_BLOCKS=0")
  names=now
  [ -n "${STRATA_KERNELS_BEFORE:-}" ] && { kb_build before "$STRATA_KERNELS_BEFORE" & names="before now"; }
  kb_build now csrc/cuda &
  for v in "${kvariants[@]}"; do
    [ -n "${STRATA_KERNELS_VARIANTS:-}" ] && [[ " $STRATA_KERNELS_VARIANTS " != *" ${v%%:*} "* ]] \
      && continue
    # shellcheck disable=SC2086
    kb_build "${v%%:*}" csrc/cuda ${v#*:} &
    names="$names ${v%%:*}"
  done
  wait
  for name in $names; do
    [ -x "/tmp/kbench_$name" ] || continue
    step "kbench_$name" 60 "/tmp/kbench_$name" --dump "/tmp/kbench_$name.bin" \
      --json "$out/kbench_$name.json"
    [ "$name" != before ] && [ -f /tmp/kbench_before.bin ] && \
      { cmp /tmp/kbench_before.bin "/tmp/kbench_$name.bin" && \
        echo "$name: bitwise equal to before" | tee -a "$out/kbench_$name.log"; }
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
    equal = "bitwise equal to before" in log or "before" not in names
    if name != "before" and "route_xs" in us and "bitwise equal" in log and equal:
        t[name] = (us, flags)
if "now" in t:
    # The GPU's own times (queued behind the bench's hold kernel) where the bench has them.
    route = min((n for n in t if n == "now" or n.startswith("r")),
                key=lambda n: t[n][0].get("route_gpu", t[n][0]["route_xs"]))
    dec = min((n for n in t if n == "now" or n.startswith("d")),
              key=lambda n: t[n][0].get("experts_gpu", t[n][0].get(
                  "experts_seq", t[n][0]["gate_up"] + t[n][0]["down"])))
    print(" ".join([f for f in t[route][1] if "ROUTE" in f] + [f for f in t[dec][1] if "DECODE" in f]))
PY
)
  echo "tuning chosen: '${tuning}'"
  echo "$tuning" > /tmp/strata-cuda-tuning
  for name in before now; do  # ncu: 2 launches of route, then gate_up and down
    [ -x "/tmp/kbench_$name" ] && [ "${STRATA_KERNELS_NCU:-1}" != 0 ] || continue
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
    [ "${STRATA_KERNELS_NCU:-1}" != 0 ] && step ncu_tuned 120 ncu --clock-control none \
      -k regex:"route_kernel|decode_kernel|direct" --launch-skip 404 --launch-count 4 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      /tmp/kbench_tuned
  fi
fi
# One build folder per source tree: several trees share a warm machine (CMake refuses a cache
# made from another source directory).
build=${STRATA_BUILD_DIR:-/tmp/strata-build-$(printf %s "$PWD" | md5sum | cut -c1-8)}
build_cmd="cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DSTRATA_BUILD_PYTHON=ON -DSTRATA_CUDA=ON -DSTRATA_CUDA_TEST_PLANT=ON -DSTRATA_BUILD_BENCH=ON \
  -DPython_EXECUTABLE=\$(command -v $py) \
  -Dpybind11_DIR=\$($py -m pybind11 --cmakedir) -DCMAKE_CUDA_FLAGS='$tuning' && cmake --build $build -j16 --target _core _cuda _bench strata_cuda_check"
# The bf16 tensor-core kernels against torch: no Python build either.
if wants prompt; then
  # The build (whose flags no prompt step changes) compiles beside the bench's libraries, and
  # is finished before anything is timed; the build step below then finds it up to date.
  timeout 240 bash -c "$build_cmd" > "$out/build_early.log" 2>&1 &
  pb_build() {  # pb_build NAME DIR [nvcc flags]: benchmarks/native/cuda_prompt_bench.cu as a library
    local name=$1 dir=$2
    shift 2
    local mma=()
    [ -f "$dir/kernels/mma_experts.cu" ] && mma=("$dir/kernels/mma_experts.cu")
    wgmma_object "prompt_$name" "$dir" "$@" && mma+=("/tmp/wgmma_prompt_$name.o")
    nvcc -std=c++20 -O3 -arch=sm_90 -shared -Xcompiler -fPIC "$@" -I"$dir" -Icsrc/engine \
      -o "/tmp/libprompt_$name.so" benchmarks/native/cuda_prompt_bench.cu \
      "$dir/kernels/experts.cu" "${mma[@]}" >> "$out/prompt_build_$name.log" 2>&1 \
      || echo "prompt bench build $name failed"
  }
  # Neighbours of the tensor-core kernels' tuning knobs (mma_experts.cu): timed beside the
  # defaults and checked bitwise against them; the defaults change by hand, from these figures.
  M=-DSTRATA_CUDA_MMA
  # smem: the prompt kernels splitting float32 rows in every block (no pieces scratch); p2: the
  # previous prompt tiling (64 or 128 output rows, 4 warps, 64 tokens) at every row count; r4:
  # the large tiling at every row count; s512: the small one below 512 rows only; ps3: 3
  # k-stages; dw8: 8 decode warps.
  # wgmma: the whole bench on the opt-in wgmma family (STRATA_CUDA_BF16=wgmma in the backend),
  # whose bits the run compares with the mma.sync family's; wgmma_one_piece: its one-piece build;
  # auto: the backend's default where the families agree (wgmma from 8 rows, mma.sync below);
  # xr0: gate_up on three pieces whatever x holds (what the one-piece path costs others).
  variants=("wgmma:-DSTRATA_PB_BF16_WGMMA=1" "auto:-DSTRATA_PB_BF16_WGMMA=2"
            "xr0:-DSTRATA_CUDA_X_ONE_PIECE=0"
            "wgmma_one_piece:-DSTRATA_PB_BF16_WGMMA=1 -DSTRATA_CUDA_MMA_ONE_PIECE_BENCH"
            "smem:${M}_PROMPT_PIECES=0" "p2:${M}_PROMPT_ROW_WARPS=2 ${M}_SMALL_BELOW_ROWS=0"
            "r4:${M}_SMALL_BELOW_ROWS=0" "s512:${M}_SMALL_BELOW_ROWS=512"
            "ps3:${M}_PROMPT_STAGES=3" "dw8:${M}_DECODE_WARPS=8")
  pb_build now csrc/cuda &
  pb_build one_piece csrc/cuda -DSTRATA_CUDA_MMA_ONE_PIECE_BENCH &
  [ -n "${STRATA_KERNELS_BEFORE:-}" ] && pb_build before "$STRATA_KERNELS_BEFORE" &
  for v in "${variants[@]}"; do
    # STRATA_PROMPT_VARIANTS (names) narrows them.
    [ -n "${STRATA_PROMPT_VARIANTS:-}" ] && [[ " $STRATA_PROMPT_VARIANTS " != *" ${v%%:*} "* ]] \
      && continue
    # shellcheck disable=SC2086
    pb_build "${v%%:*}" csrc/cuda ${v#*:} &
  done
  wait
  extra=()
  [ -f /tmp/libprompt_before.so ] && extra=(--lib-before /tmp/libprompt_before.so)
  for v in "${variants[@]}"; do
    [ -f "/tmp/libprompt_${v%%:*}.so" ] && extra+=(--lib-variant "${v%%:*}=/tmp/libprompt_${v%%:*}.so")
  done
  # STRATA_PROMPT_ROWS: the waves' row counts (the bench's default: 128 512 2048).
  # shellcheck disable=SC2086
  step prompt 300 $py benchmarks/cuda_prompt.py --lib-now /tmp/libprompt_now.so \
    --lib-one-piece /tmp/libprompt_one_piece.so "${extra[@]}" --json "$out/cuda_prompt.json" \
    --rows ${STRATA_PROMPT_ROWS:-128 512 2048}
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
# Whether this GPU runs the opt-in wgmma family (Hopper): its tests and sanitizer runs need it.
has_wgmma() { $py -c "import sys, strata_stream._cuda as c; sys.exit(bool(c.wgmma_unavailable()))"; }
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
  # The bf16 tests again on each family alone, where this GPU runs wgmma (Hopper; the default
  # there takes both: wgmma for prompt waves, mma.sync for decode).
  if has_wgmma; then
    STRATA_CUDA_BF16=wgmma step tests_wgmma 200 $py -m pytest -q -p no:cacheprovider -m cuda \
      tests/cuda -k bf16
    STRATA_CUDA_BF16=mma step tests_mma 200 $py -m pytest -q -p no:cacheprovider -m cuda \
      tests/cuda -k bf16
  fi
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
      -k "odd_widths or (routed_calls and mxfp4) or (many_experts and q4) or (same_bits and bf16) or chunks_run_back_to_back or part_copies_of_a_failed_read"
    # Each family's bf16 passes alone under the same tool, where this GPU runs wgmma.
    for family in wgmma mma; do
      has_wgmma &&
        STRATA_CUDA_BF16=$family step "sanitize_${tool}_$family" 120 compute-sanitizer \
          --tool "$tool" --error-exitcode 9 --target-processes all $py -m pytest -q \
          -p no:cacheprovider -m cuda tests/cuda/test_cuda_kernels.py -k "same_bits and bf16"
    done
  done
fi
if wants bench; then
  step io_ref_build 60 nvcc -O2 -std=c++17 -o /tmp/io_ref benchmarks/native/cuda_io_reference.cu
  # What each host-to-device copy costs the copy engine (the mirror's copy chunks).
  step copy_engine_build 60 nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/copy_engine \
    benchmarks/native/cuda_copy_engine.cu && step copy_engine 60 /tmp/copy_engine
  STRATA_CUDA_TRACE=1 step bench 240 $py benchmarks/cuda.py --layers 2 --experts 16 --decode \
    --backends ${STRATA_BENCH_BACKENDS:-cpu cuda-device cuda-mapped} \
    --io-reference /tmp/io_ref --json "$out/cuda_bench.json"
  # A decode layer with all of Qwen3-30B-A3B's 128 experts (the route kernel's real width).
  step bench128 120 $py benchmarks/cuda.py --layers 1 --experts 128 --prompt-rows \
    --backends cuda-device --json "$out/cuda_bench128.json"
fi
# io (only when named; not part of all): the IO path, a lone miss and decode at each of
# STRATA_IO_SWEEP's IO-thread counts (default 8 16: the default's cap and the H200 host's cores),
# side by side in one call (docs/cuda.md, "What is left").
if [[ "$what" == *" io "* ]]; then
  sweep=${STRATA_IO_SWEEP:-8 16}
  [ -x /tmp/io_ref ] || step io_ref_build 60 nvcc -O2 -std=c++17 -o /tmp/io_ref \
    benchmarks/native/cuda_io_reference.cu
  [ -f /tmp/decode.strpk ] || step decode_pack 120 $py benchmarks/cuda.py --write-decode-pack \
    --decode-pack /tmp/decode.strpk
  cat /tmp/decode.strpk > /dev/null  # warm in the page cache, as every figure here assumes
  # shellcheck disable=SC2086
  STRATA_CUDA_TRACE=1 step io_path 200 $py benchmarks/io_path.py --pack /tmp/decode.strpk \
    --backend cuda --io-threads $sweep --rounds 2 --prompt-rows 0 --io-reference /tmp/io_ref \
    --json "$out/io_path.json"
  # shellcheck disable=SC2086
  step miss 150 $py benchmarks/miss_latency.py --formats q4 bf16 --backend cuda \
    --io-threads $sweep --rounds 3 --pack-dir /tmp/packs --json "$out/miss.json"
  for t in $sweep; do
    step "decode_$t" 200 $py benchmarks/cuda.py --backends --decode --decode-pack /tmp/decode.strpk \
      --io-reference /tmp/io_ref --io-threads "$t" --fractions 0.1 0.25 --json "$out/decode_$t.json"
  done
fi
