#!/usr/bin/env bash
# The GPU checks and benchmarks in one go, on a CUDA machine, from the repository root:
#   OUT=results COMMIT=$(git rev-parse --short HEAD) TESTS="test_kernels_quant_linear.py" BENCHES="resident sweep" bench/gpu_suite.sh
# (TESTS_K="a or b": a pytest -k expression over those files)
# Installs the project (and the wheels in $WHEELS, if set, for a machine without a package index),
# writes the synthetic full-size artifact once (/tmp/q36.ninfer), runs the test files in TESTS from a
# copy outside the source tree (the installed package is what they import) and each benchmark in
# BENCHES (resident, resident_hf (with the full transformers baseline), resident_32k, sweep, paths (matrix-vector vs tensor-core tiles, 1-16 tokens), kernels, serve (options in SERVE_ARGS, e.g. --serve-arg=--vram-budget=15GiB), spec (options in SPEC_ARGS), short_prompts, warm_up (kernels a served engine first launches after its warm-up), kernel_formats (nvfp4 against row-split per product), l2 (each decode product from HBM against L2-resident), attention (attention decode's spans and launch shapes), nvfp4_pair (the official and nvfp4 artifacts resident and at 15 GiB in one run), offload_kernels (both artifacts at 15 GiB with their decode kernels by launch shape), offload (15 GiB and
# the accelerate floor), offload_sweep (five budgets, ~7 min), offload_cpu (15 GiB, the three miss paths), offload_all (15, 12, 20, 24 GiB and the three miss paths, one load each, ~6 min), offload_prefill (at PREFILL_BUDGET GiB, default 15), nvfp4, pinning, prompt_cache (a chat and an agent, cold against cached, resident and at 15 GiB; options in PROMPT_CACHE_ARGS), ab (bench/step_ab.py with the variants in AB_ARGS), profile_nopdl (the one-token step, the verification and the batch step by launch shape with PDL off, so that each kernel's time excludes its wait for the one before; trace routing), ncu (Nsight Compute
# sections of bench/ncu_probe.py's launches, the cases in NCU_CASES)), their
# JSON and logs under $OUT. One device call runs at most 10 minutes: offload_sweep and the floor (~3 min more) do not fit in one.
set -o pipefail
: "${OUT:?set OUT to the folder for the results}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ -n "$WHEELS" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation . > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
COMMIT=${COMMIT:-unknown}  # pass it: a device copy's git metadata can be older than its tree
RUN=$(mktemp -d)
cp -r bench tests "$RUN"/ && cd "$RUN" || exit 1
artifact() { [ -f /tmp/q36.ninfer ] || python3 bench/make_synthetic.py /tmp/q36.ninfer > "$OUT/synthetic.log" 2>&1; }
nvfp4_artifact() { [ -f /tmp/q36_nvfp4.ninfer ] || python3 bench/make_synthetic.py /tmp/q36_nvfp4.ninfer --recipe nvfp4 > "$OUT/synthetic_nvfp4.log" 2>&1; }
if [ -n "$TESTS" ]; then
  # SIGINT at the limit: pytest stops and still prints which tests passed and failed
  # TESTS_K: a -k expression (spaces kept), e.g. TESTS_K="warm_up or attention"
  # TESTS_EACH=1: one pytest process per file (a failed test's engine, kept alive by its traceback, then holds no
  # memory in the next file's process: test_vram_bound_gpu.py measures the process's peak)
  groups="$TESTS"; [ -n "$TESTS_EACH" ] || groups="ALL"
  for group in $groups; do
    files=$group; [ "$group" = ALL ] && files=$TESTS
    (cd tests && timeout -s INT -k 30 "${TEST_TIMEOUT:-600}" python3 -m pytest -q -rfE -p no:cacheprovider $files ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
      | tee -a "$OUT/tests.log" | tail -15)
  done
fi
for bench in $BENCHES; do
  echo "== $bench"
  case $bench in
    resident) artifact && python3 bench/resident.py /tmp/q36.ninfer --out "$OUT/resident.json" --contexts 1024 --prefills 24 4096 \
      --skip-transformers --commit "$COMMIT" 2>&1 | tail -8 ;;
    resident_hf) artifact && python3 bench/resident.py /tmp/q36.ninfer --out "$OUT/resident_hf.json" --contexts 1024 --prefills 4096 \
      --batches 1 --commit "$COMMIT" 2>&1 | tail -8 ;;
    resident_32k) artifact && python3 bench/resident.py /tmp/q36.ninfer --out "$OUT/resident_32k.json" --contexts 32768 --prefills 16384 \
      --batches --skip-transformers --commit "$COMMIT" 2>&1 | tail -6 ;;
    sweep) python3 bench/sweep_decode.py --out "$OUT/sweep.json" --commit "$COMMIT" 2>&1 | tail -100 ;;
    paths) python3 bench/sweep_decode.py --sweeps paths --out "$OUT/paths.json" --commit "$COMMIT" 2>&1 | tail -60 ;;
    kernels) python3 bench/kernel_sweeps.py --out "$OUT/kernels.json" --commit "$COMMIT" 2>&1 | tail -60 ;;
    few_tokens) python3 bench/few_tokens_sweep.py --out "$OUT/few_tokens.json" --commit "$COMMIT" $FEW_TOKENS_ARGS 2>&1 | tail -30 ;;
    kernel_formats) python3 bench/kernel_sweeps.py --sweeps formats --out "$OUT/kernel_formats.json" --commit "$COMMIT" 2>&1 | tail -30 ;;
    l2) python3 bench/l2_residency.py --out "$OUT/l2_residency.json" --commit "$COMMIT" 2>&1 | tail -7 ;;
    attention) python3 bench/sweep_decode.py --sweeps attention --out "$OUT/attention.json" --commit "$COMMIT" 2>&1 | tail -33 ;;
    serve) artifact && python3 bench/serve.py /tmp/q36.ninfer --out "$OUT/serve.json" --clients 1 8 --max-tokens 96 --commit "$COMMIT" \
      $SERVE_ARGS 2>&1 | tail -12 ;;
    spec) artifact && python3 bench/spec.py /tmp/q36.ninfer --out "$OUT/spec.json" --commit "$COMMIT" $SPEC_ARGS 2>&1 | tail -12 ;;
    short_prompts) artifact && python3 bench/short_prompts.py /tmp/q36.ninfer --out "$OUT/short_prompts.json" --commit "$COMMIT" 2>&1 | tail -14 ;;
    warm_up) artifact && python3 bench/warm_up_coverage.py /tmp/q36.ninfer --out "$OUT/warm_up_coverage.json" --commit "$COMMIT" 2>&1 | tail -10 ;;
    offload) artifact && python3 bench/offload.py /tmp/q36.ninfer --out "$OUT/offload.json" --budgets 15 --tokens 128 --warmup 128 \
      --commit "$COMMIT" 2>&1 | tail -12 ;;
    offload_sweep) artifact && python3 bench/offload.py /tmp/q36.ninfer --out "$OUT/offload_sweep.json" --budgets 15 12 18 20 24 \
      --tokens 128 --warmup 128 --skip-accelerate --commit "$COMMIT" 2>&1 | tail -16 ;;
    nvfp4) nvfp4_artifact &&
      python3 bench/resident.py /tmp/q36_nvfp4.ninfer --out "$OUT/resident_nvfp4.json" --contexts 1024 --prefills 4096 --batches 1 \
        --skip-transformers --commit "$COMMIT" 2>&1 | tail -5 &&
      python3 bench/offload.py /tmp/q36_nvfp4.ninfer --out "$OUT/offload_nvfp4.json" --budgets 15 --tokens 128 --warmup 128 \
        --skip-accelerate --commit "$COMMIT" 2>&1 | tail -3 ;;
    nvfp4_pair) nvfp4_artifact && artifact &&
      for recipe in official nvfp4; do
        file=/tmp/q36.ninfer; [ $recipe = nvfp4 ] && file=/tmp/q36_nvfp4.ninfer
        python3 bench/resident.py $file --out "$OUT/resident_pair_$recipe.json" --contexts 1024 --prefills 24 --batches \
          --skip-transformers --commit "$COMMIT" 2>&1 | tail -3
        python3 bench/offload.py $file --out "$OUT/offload_pair_$recipe.json" --budgets 15 --tokens 128 --warmup 128 \
          --skip-accelerate --commit "$COMMIT" 2>&1 | tail -3
      done ;;
    offload_kernels) nvfp4_artifact && artifact &&
      for recipe in official nvfp4; do
        file=/tmp/q36.ninfer; [ $recipe = nvfp4 ] && file=/tmp/q36_nvfp4.ninfer
        python3 bench/offload.py $file --out "$OUT/offload_kernels_$recipe.json" --budgets 15 --tokens 128 --warmup 128 \
          --kernel-steps 16 --skip-accelerate --commit "$COMMIT" 2>&1 | tail -2
      done ;;
    offload_cpu) artifact && python3 bench/offload.py /tmp/q36.ninfer --out "$OUT/offload_cpu.json" --budgets 15 --tokens 128 --warmup 128 \
      --miss-paths pcie cpu auto --miss-path-loads 2 --skip-accelerate --trace-dir "$OUT/traces" --commit "$COMMIT" 2>&1 | tail -6 ;;
    offload_all) artifact && python3 bench/offload.py /tmp/q36.ninfer --out "$OUT/offload_all.json" --budgets 15 12 20 24 --tokens 128 --warmup 128 \
      --miss-paths pcie cpu auto --miss-path-loads 1 --skip-accelerate --commit "$COMMIT" 2>&1 | tail -10 ;;
    ab) artifact && python3 bench/step_ab.py /tmp/q36.ninfer --out "$OUT/step_ab.json" --commit "$COMMIT" $AB_ARGS 2>&1 | tail -12 ;;
    profile_nopdl) artifact && NINFER_PDL=0 python3 bench/step_ab.py /tmp/q36.ninfer --out "$OUT/step_ab_nopdl_profile.json" \
      --commit "$COMMIT" --routing trace --profile 2>&1 | tail -3 ;;
    ncu) ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)  # NCU_CASES: bench/ncu_probe.py's cases
      "$ncu" --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        python3 bench/ncu_probe.py ${NCU_CASES:+--cases $NCU_CASES} > "$OUT/ncu.txt" 2>&1
      python3 bench/ncu_summary.py "$OUT/ncu.txt" --out "$OUT/ncu.json" --commit "$COMMIT" && grep -c '"kernel"' "$OUT/ncu.json" ;;
    prompt_cache) artifact && python3 bench/prompt_cache.py /tmp/q36.ninfer --out "$OUT/prompt_cache.json" --commit "$COMMIT" \
      $PROMPT_CACHE_ARGS 2>&1 | tail -4 ;;
    pinning) artifact && python3 bench/pinning.py /tmp/q36.ninfer --out "$OUT/pinning.json" --commit "$COMMIT" 2>&1 | tail -6 ;;
    offload_prefill) artifact && python3 bench/offload_prefill.py /tmp/q36.ninfer --budget "${PREFILL_BUDGET:-15}" --out "$OUT/offload_prefill.json" --commit "$COMMIT" 2>&1 | tail -6 ;;
    *) echo "unknown benchmark $bench" ;;
  esac
done
