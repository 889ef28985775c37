#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, sanitizer sweep, benchmark.
#
#   tools/gpu_check.sh [build] [tests] [tests-slow] [tests-slow-rest] [tests-slow-mods] [fuzz] [long] [sanitize] [bench]
#                      [decode] [dense] [main] [fused] [sharding] [ab] [newest-jax]
#                      (default: build tests newest-jax sanitize bench decode main)
#
# tests       the fast GPU tier, -m "gpu and not slow" (every family, dtype, head-dim bucket and
#             mask at least once; meant to stay under 5 minutes on an H100; on an H200 on
#             2026-11-28 it had grown to ~2280 s of test time over 8 processes: 411 of 419 done
#             in 330 s, none failed, so the limit is 400 s; the test time is mostly compiling on
#             the host, Pallas's Triton kernels above all (80-93 s a test), so the GPU tiers run
#             one process a core up to 16: 51 such tests took 225 s over 16), then the API tests
# newest-jax  the whole CPU suite on this machine's JAX (newer than the one CI installs),
#             JAX_PLATFORMS=cpu with 4 host devices (CI's run has one: the partition rules'
#             paths run here; 683 s on 2 processes on a CPU machine, 2026-12-02): a JAX release
#             that breaks the CPU path shows up whenever the GPU is tested
# tests-slow  the rest of the sweep, -m "gpu and slow", for the training kernels
#             (test_cuda_kernels, test_diagonal_offsets: every tile candidate, float16 grids,
#             32k sequences)
# tests-slow-rest  the rest of -m "gpu and slow": decode, non-finite, Pallas, forward mode, debug
#             flags (the two slow stages together ran past one call's 10 minutes; tenth session)
# tests-slow-mods  the rest of -m "gpu and slow" for the score modifiers and dense terms (ALiBi,
#             segment ids, soft-cap, bias/mask): the fast tier keeps each dtype, mask and family
#             of theirs once (it had grown past its 400 s: 428 of 429 done on an H200,
#             2026-11-30, at 5170 s of test time over 16 processes; split, the fast tier ran in
#             339 s and this stage in 252 s, 24 tests, the same day)
#             tests + tests-slow + tests-slow-rest + tests-slow-mods + fuzz = the whole GPU suite
# fuzz        the contract fuzzing alone (tests/test_contract.py on the GPU: 2000 native calls in
#             8 shards and 200 Pallas ones; JAXFLASH_FUZZ_GPU_EXAMPLES sets the native count)
# long        tools/long_sequences.py: S = 128k, 256k forward+backward and 1M forward (causal
#             bf16, B 1, 8 heads, D 128), finite and checked against a chunked float32 reference
#             on sampled rows; sizes that do not fit in the GPU's memory are skipped
# decode      the decode kernels (split-KV, GQA packing, paged K/V): their tests on this GPU, then
#             benchmarks/bench_decode.py
# dense       the dense bias and mask: tests/test_dense.py's GPU tests (the Hopper forward's staged
#             bias tile, the sm80 kernels, Pallas), memcheck of sanitizer_sweep.py --dense-only, then
#             benchmarks/bench_dense.py
# fused       the one-pass Hopper backward: its GPU tests, forward+backward rates of
#             native (as dispatched), native_two_kernel, native_fused and cuDNN in one run, then ncu of
#             the fused kernel (warp-specialised at D = 64 and 128) and of the two-kernel backward's dK/dV
#             pass (at D = 128 the warp-specialised one without dQ), D = 128, S = 16k
# sharding    benchmarks/bench_sharding.py on every visible GPU (meant for two): batch sharding,
#             ring attention at 64k/128k against one GPU, the ppermute overlap, a profiler trace
# ab          a kernel A/B of this build against ab_base/ (tools/ab_base.sh REV here, and the
#             device call carries ab_base): the base built (beside this build when the call
#             runs both stages) and installed beside it, then
#             tools/ab_kernels.py times AB_KERNEL (an ncu regex; unset: the harness's whole
#             call) at each of AB_SHAPES (profile_call.py arguments, ';'-separated),
#             base / this / this / base
# sanitize    compute-sanitizer memcheck, racecheck and synccheck over tools/sanitizer_sweep.py; the
#             whole sweep under the three tools ran past one call's 10 minutes on an H100 (sixteenth
#             session: memcheck and racecheck ~9 min): split it with SANITIZE_TOOLS (a subset of the
#             three) and SANITIZE_ARGS (the sweep's --training-only / --decode-only / --dense-only / --head-dims)
# BENCH_ARGS are passed to benchmarks/bench_attention.py, DECODE_ARGS to
# benchmarks/bench_decode.py, PYTEST_K to pytest -k.
# On an H100 (2026-11-21): build 20 s, sanitizer sweep ~2 min (since grown: see sanitize), a D=128
# slice of the benchmark ~70 s; the full grid takes longer, so split stages over calls when a call is
# time-limited.
# Logs go to $OUT (or ./gpu_out); each stage prints one summary line, repeated at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build tests newest-jax sanitize bench decode main)
summary=()
note() { summary+=("$1"); echo "== $1"; }
has() { [[ " ${stages[*]} " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/device.txt"

# The ab stage's base build (ab_base/ into $ab_base_path, its log in
# ab_build.log); with the build stage it runs beside this build. The build
# is bound by its longest translation units, not by the cores: two builds
# one after the other took 122 + 130 s of an A/B call (2026-12-02).
ab_base_path=/tmp/jaxflash_ab_base
build_ab_base() {
  rm -rf "$ab_base_path"
  (cd ab_base && JAXFLASH_CUDA=ON python3 -m pip install --no-build-isolation --no-deps --target "$ab_base_path" . \
      > "$OUT/ab_build.log" 2>&1)
}
ab_ready() { has ab && [ -d ab_base ] && [ -n "${AB_SHAPES:-}" ]; }
ab_pid=""
if has build && ab_ready; then
  ab_start=$SECONDS
  build_ab_base &
  ab_pid=$!
fi

if has build; then
  start=$SECONDS
  # The build directory (build/, kept between calls) decides what to recompile
  # by file times, which a copied tree does not keep in order: a source put
  # back to an older content can look older than its object and be skipped.
  # When the sources' content differs from the last build's, every source is
  # touched, so ninja recompiles what they feed.
  src_sum=$(find ffi CMakeLists.txt -type f | sort | xargs sha1sum | sha1sum | cut -d' ' -f1)
  if [ "$src_sum" != "$(cat build/.sources.sha1 2>/dev/null)" ]; then
    find ffi CMakeLists.txt -type f -exec touch {} +
  fi
  if JAXFLASH_CUDA=ON python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1; then
    nonzero=$(grep "spill stores" "$OUT/build.log" | grep -vc " 0 bytes spill stores")
    # ptxas reports wgmma it had to serialise ("Potential Performance Loss: wgmma
    # ... serialized", e.g. C7518) as info lines, which --warning-as-error does not catch.
    serial=$(grep -c "Potential Performance Loss: wgmma" "$OUT/build.log")
    mkdir -p build && echo "$src_sum" > build/.sources.sha1
    note "build ok in $((SECONDS - start)) s ($nonzero kernels with spills, $serial with serialised wgmma)"
  else
    tail -n 40 "$OUT/build.log"; note "build FAILED"; printf '%s\n' "${summary[@]}"; exit 1
  fi
fi

# Run from outside the checkout so the installed package, not the source tree, is imported.
run_py() { (cd /tmp && "$@"); }
repo=$PWD

# pytest under a time limit, from outside the checkout; notes the stage's
# summary line (its last line, or that it timed out). A test still running
# after TEST_TIMEOUT s (default 120) has its stack dumped into the log, so a
# hung kernel names its test (grep the log for "Timeout").
pytest_stage() {  # name, time limit in s, log, pytest arguments...
  local name=$1 limit=$2 log=$3 start=$SECONDS
  shift 3
  run_py timeout "$limit" python3 -m pytest -q -p no:cacheprovider -o faulthandler_timeout="${TEST_TIMEOUT:-120}" \
      "$@" > "$OUT/$log" 2>&1
  local rc=$?
  local last; last=$(tail -n 1 "$OUT/$log")
  [ "$rc" -eq 124 ] && last="TIMED OUT after $limit s: $last ($(grep -c 'Timeout (' "$OUT/$log") stack dumps)"
  note "$name: $last [$((SECONDS - start)) s]"
}

# A script under a time limit, from outside the checkout: its output goes to
# $OUT/<log> and is shown, with one summary line (exit status, last line, time).
script_stage() {  # name, time limit in s, log, command...
  local name=$1 limit=$2 log=$3 start=$SECONDS
  shift 3
  run_py timeout "$limit" "$@" > "$OUT/$log" 2>&1
  local rc=$?
  cat "$OUT/$log"
  note "$name: exit $rc, $(tail -n 1 "$OUT/$log") [$((SECONDS - start)) s]"
}

# The GPU-marked tests of one tier (CUDA kernels, Pallas on Triton), spread
# over processes: most of their time is compiling references. PYTEST_K=<expr>
# narrows them (e.g. to re-run what failed).
# Each test's time goes to <log>.times as it finishes (sort -rn it), so a tier
# stopped at its limit still shows where the time went.
gpu_tier() {  # name, marker expression, time limit in s, log, test paths and more pytest arguments...
  local name=$1 marker=$2 limit=$3 log=$4 procs
  shift 4
  procs=$(nproc); [ "$procs" -gt 16 ] && procs=16
  JAXFLASH_TEST_TIMES="$OUT/$log.times" pytest_stage "$name" "$limit" "$log" -n "$procs" --dist worksteal -rfE \
      -m "$marker" \
      ${PYTEST_K:+-k "$PYTEST_K"} --durations=15 "$@"
}

if has tests; then
  gpu_tier "gpu tests (fast tier)" "gpu and not slow" 400 tests.log "$repo/tests"
  run_py timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 "$repo/tests/test_api.py" \
      >> "$OUT/tests.log" 2>&1
  note "api tests on gpu: $(tail -n 1 "$OUT/tests.log")"
fi

if has newest-jax; then
  jax_version=$(python3 -c "import jax; print(jax.__version__)")
  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 pytest_stage \
      "cpu tests on jax $jax_version" 540 newest_jax.log -n 8 --dist worksteal -rfE "$repo/tests"
fi

# The slow tier in two stages, each one call's worth; the contract fuzz is the
# fuzz stage's (its shards alone fill most of a call).
slow_training=(test_cuda_kernels.py test_diagonal_offsets.py)
slow_mods=(test_alibi.py test_segments.py test_softcap.py test_dense.py)
if has tests-slow; then
  gpu_tier "gpu tests (slow tier, training kernels)" "gpu and slow" 500 tests_slow.log \
      "${slow_training[@]/#/$repo/tests/}"
fi

if has tests-slow-rest; then
  gpu_tier "gpu tests (slow tier, the rest)" "gpu and slow" 500 tests_slow_rest.log \
      "$repo/tests" --ignore "$repo/tests/test_contract.py" "${slow_training[@]/#/--ignore=$repo/tests/}" \
      "${slow_mods[@]/#/--ignore=$repo/tests/}"
fi

if has tests-slow-mods; then
  gpu_tier "gpu tests (slow tier, score modifiers and dense terms)" "gpu and slow" 500 tests_slow_mods.log \
      "${slow_mods[@]/#/$repo/tests/}"
fi

if has fuzz; then
  gpu_tier "contract fuzzing on gpu" "gpu" 560 fuzz.log "$repo/tests/test_contract.py"
fi

if has long; then
  script_stage "long sequences" 560 long.log python3 "$repo/tools/long_sequences.py"
fi

if has ab; then
  if [ ! -d ab_base ]; then
    note "ab: no ab_base/ (run tools/ab_base.sh REV before the call, and carry ab_base)"
  elif [ -z "${AB_SHAPES:-}" ]; then
    note "ab: set AB_SHAPES (profile_call.py arguments, ';'-separated) and AB_KERNEL (an ncu kernel regex)"
  else
    if [ -n "$ab_pid" ]; then
      wait "$ab_pid"
      base_rc=$?
      how="beside this build, done $((SECONDS - ab_start)) s after it began"
    else
      ab_start=$SECONDS
      build_ab_base
      base_rc=$?
      how="in $((SECONDS - ab_start)) s"
    fi
    if [ "$base_rc" -eq 0 ]; then
      note "ab: base $(cat ab_base/.revision 2>/dev/null) built $how"
      script_stage "ab" 420 ab.log python3 "$repo/tools/ab_kernels.py" --base-path "$ab_base_path" \
          --kernel "${AB_KERNEL:-}" --shapes "$AB_SHAPES" --launches "${AB_LAUNCHES:-2}"
    else
      tail -n 20 "$OUT/ab_build.log"; note "ab: base build FAILED"
    fi
  fi
fi

if has sanitize; then
  start=$SECONDS
  : > "$OUT/sanitizer.log"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    XLA_PYTHON_CLIENT_ALLOCATOR=platform run_py compute-sanitizer --tool "$tool" \
        --kernel-name kns=jaxflash --error-exitcode 99 python3 "$repo/tools/sanitizer_sweep.py" \
        ${SANITIZE_ARGS:-} >> "$OUT/sanitizer.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool: exit $rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tail -n 1)"
  done
  note "sanitizer sweep took $((SECONDS - start)) s"
fi

if has bench; then
  script_stage "benchmark" 480 bench.log python3 "$repo/benchmarks/bench_attention.py" \
      --csv "$OUT/bench.csv" --png "$OUT/bench.png" ${BENCH_ARGS:-}
fi

if has decode; then
  # The decode kernels (split-KV, GQA packing, paged K/V) on this GPU: their
  # GPU tests, the non-finite cases of decode steps, and the CPU-run decode and
  # paged tests on the GPU backend (the Pallas decode kernel on Triton among
  # them), then the decode benchmark.
  nonfinite="$repo/tests/test_nonfinite.py"
  pytest_stage "decode tests" 300 decode_tests.log -n 8 "$repo/tests/test_cuda_decode.py" \
      "$repo/tests/test_decode.py" "$repo/tests/test_paged.py" \
      "$nonfinite::test_nonfinite_cuda_decode" "$nonfinite::test_nonfinite_pallas_decode_gpu" \
      "$nonfinite::test_padding_never_leaks_split_gpu"
  script_stage "decode benchmark" 300 decode.log python3 "$repo/benchmarks/bench_decode.py" \
      --csv "$OUT/decode.csv" --png "$OUT/decode.png" ${DECODE_ARGS:-}
fi

if has dense; then
  pytest_stage "dense tests" 300 dense_tests.log -n 8 -m gpu "$repo/tests/test_dense.py"
  XLA_PYTHON_CLIENT_ALLOCATOR=platform run_py timeout 240 compute-sanitizer --tool memcheck \
      --kernel-name kns=jaxflash --error-exitcode 99 python3 "$repo/tools/sanitizer_sweep.py" --dense-only \
      > "$OUT/dense_sanitizer.log" 2>&1
  rc=$?
  note "dense memcheck: exit $rc, $(grep -E 'ERROR SUMMARY' "$OUT/dense_sanitizer.log" | tail -n 1)"
  script_stage "dense benchmark" 240 dense_bench.log python3 "$repo/benchmarks/bench_dense.py"
fi

if has fused; then
  pytest_stage "fused backward tests" 240 fused_tests.log -n 8 -m gpu -k fused "$repo/tests"
  script_stage "fused backward benchmark" 300 fused_bench.log python3 \
      "$repo/benchmarks/bench_attention.py" --no-forward --peers native,native_two_kernel,native_fused,cudnn \
      --seqs 4096,16384 --csv "$OUT/fused.csv"
  for mode in "--fused" ""; do
    run_py timeout 120 ncu --kernel-name "regex:WsBwdKernel|DkDvKernel" --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        python3 "$repo/tools/profile_call.py" --backward $mode >> "$OUT/fused_ncu.log" 2>&1
    note "ncu dK/dV kernel ${mode:-(two kernels)}: exit $?"
  done
fi

if has main; then
  run_py python3 -m jaxflash > "$OUT/main.log" 2>&1
  note "python -m jaxflash exit $?"
  cat "$OUT/main.log"
fi

if has sharding; then
  # Batch sharding, ring attention at 64k/128k and its overlap on every visible GPU
  # against one (benchmarks/bench_sharding.py); not yet timed on a GPU, hence the limit.
  script_stage "sharding benchmark" 470 sharding.log python3 "$repo/benchmarks/bench_sharding.py" \
      --trace "$OUT/sharding_trace"
fi

printf '%s\n' "${summary[@]}"
