#!/bin/bash
# Build and test on a GPU machine: build, then the named stages, each logged under $OUT
# (default ./gpu_out). Usage: bash tools/gpu_check.sh STAGE... where a stage is
#   build     install this tree (sm_90 only, for speed) into the machine's python3
#   wheels    install the wheels carried in .whl/ (optional dependencies the machine lacks, e.g. torchao)
#   tests     every test marked cuda (TEST_PATHS: only these test files)
#   tests2    (2 GPUs) the scaler's, unscale's and the Trainer's cuda tests, their two-GPU cases included
#   sanitize  compute-sanitizer's four tools over tools/sanitize_driver.py
#   parity    our CUDA kernels against their CPU twins, bitwise where they must be (tools/kernel_parity.py)
#   kernels   python -m adaptive_amp bench --suites gpt2,many,sround,optim --stats
#   zoo       python -m adaptive_amp bench zoo (ZOO_ARGS, default --suite recovery); its JSON and table go
#             straight to $OUT/zoo/, rewritten after every run, so a run cut off at its time limit keeps them
#   e2e       python -m adaptive_amp bench --suites e2e (E2E_ARGS)
#   tune      python -m adaptive_amp bench tune (TUNE_ARGS)
#   tunepar   up to four tune suites at once, one a GPU: TUNE_ARGS_0 ... TUNE_ARGS_3 (each set one runs, on GPU i)
#   scale     python -m adaptive_amp bench scale (SCALE_ARGS, default: --layers 8, torch-bf16 only, 360 s a run)
#   examples  examples/ and the README's example on the GPU
#   scaler    GradScaler's per-step overhead against torch's, with 0% and 30% of the parameters frozen
#   multi     (2 GPUs) python -m adaptive_amp bench multi-gpu and multi-gpu-integrations under torchrun
# The *_ARGS variables pass options to those stages.
# The logs are packed into $OUT/logs.tgz (the device tool brings back at most 8 files), with
# the summary in $OUT/summary.txt. Python runs from /tmp, never from the checkout (the source folder would shadow the install).
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=${OUT:-$repo/gpu_out}
out=$(mktemp -d)
mkdir -p "$dest"
export PYTHONUNBUFFERED=1 ADAPTIVE_AMP_CUDA_ARCHS=${ADAPTIVE_AMP_CUDA_ARCHS:-90} ADAPTIVE_AMP_CUDA=1
status=0
pack() {  # the logs so far into $dest (also when a time limit stops this script)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
  date -u >> "$out/gpu.txt"
  tar czf "$dest/logs.tgz" -C "$out" .
}
child=
trap 'echo "stopped (time limit?) during the stage above" >> "$dest/summary.txt"; [ -n "$child" ] && kill $child
      pack; exit 124' TERM INT
run() {  # run NAME CMD...: time a stage, keep its log, go on after a failure
  local name=$1; shift
  local t0=$SECONDS
  # In the background and waited for, so that a TERM reaches the trap at once (bash runs traps only
  # between foreground commands).
  (cd /tmp && exec "$@") > "$out/$name.log" 2>&1 &
  child=$!
  wait $child
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s; $(tail -n 1 "$out/$name.log")" | tee -a "$dest/summary.txt"
  [ $rc -eq 0 ] || status=1
  pack  # after every stage: a call killed at its time limit may not get to run the trap's
}
for stage in "$@"; do
  case $stage in
    build) run build python3 -m pip install --no-build-isolation --no-deps "$repo"
           run info python3 -m adaptive_amp info ;;
    wheels) if compgen -G "$repo/.whl/*.whl" > /dev/null; then
              run wheels python3 -m pip install --no-deps "$repo"/.whl/*.whl
            else  # .whl/ is git-ignored: the device tool copies it only when carried (carry: [".whl"])
              echo "wheels: no wheel in .whl/ (carry it to the machine: carry [\".whl\"]); optional extras skipped" \
                | tee -a "$dest/summary.txt"; status=1
            fi ;;
    tests) paths=(); for t in ${TEST_PATHS:-tests}; do paths+=("$repo/$t"); done
           run tests python3 -m pytest "${paths[@]}" -m cuda -q -p no:cacheprovider -rfEs ;;
    tests2) run tests2 python3 -m pytest "$repo/tests/test_scaler.py" "$repo/tests/test_torch_scaler_scenarios.py" \
                "$repo/tests/test_unscale.py" "$repo/tests/test_integration_transformers.py" -m cuda -q -p no:cacheprovider ;;
    sanitize) run sanitize bash "$repo/tools/sanitize.sh" "$out" ;;
    parity) run parity python3 "$repo/tools/kernel_parity.py" ;;
    kernels) run kernels python3 -m adaptive_amp bench --suites gpt2,many,sround,optim --stats --json "$out/kernels.json" ;;
    zoo) run zoo python3 -m adaptive_amp bench zoo --out "$dest/zoo" ${ZOO_ARGS:---suite recovery} ;;
    e2e) run e2e python3 -m adaptive_amp bench --suites e2e --no-unscale --json "$out/e2e.json" ${E2E_ARGS:-} ;;
    multi) run multi_gpu torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench multi-gpu --out "$out/mg"
           run multi_gpu_integrations torchrun --standalone --nproc_per_node=2 -m adaptive_amp bench \
               multi-gpu-integrations --backend nccl --device cuda --out "$out/mgi" --timeout 120 ;;
    examples) run examples python3 -m pytest "$repo/tests/test_examples.py" "$repo/tests/test_readme.py" -q -p no:cacheprovider ;;
    scaler) run scaler python3 -m adaptive_amp bench --no-unscale --scaler --scaler-frozen 0 0.3 --json "$out/scaler.json" ;;
    tune) run tune python3 -m adaptive_amp bench tune --out "$out/tune" ${TUNE_ARGS:-} ;;
    scale) run scale python3 -m adaptive_amp bench scale --json "$out/scale.json" ${SCALE_ARGS:---layers 8 --recipes torch-bf16 --max-seconds 360} ;;
    tunepar) pids=(); t0=$SECONDS; n=0
             for i in 0 1 2 3; do v="TUNE_ARGS_$i"; [ -n "${!v:-}" ] && n=$((n + 1)); done
             # Each process gets its own share of the cores (and inductor as many compile workers): eager steps
             # are host-bound, and another process's compile workers would slow them.
             per=$(( $(nproc) / (n > 0 ? n : 1) )); k=0
             for i in 0 1 2 3; do
               v="TUNE_ARGS_$i"; [ -n "${!v:-}" ] || continue
               pin=(); command -v taskset > /dev/null && pin=(taskset -c "$((k * per))-$((k * per + per - 1))")
               (cd /tmp && CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$per exec "${pin[@]}" python3 \
                   -m adaptive_amp bench tune --out "$out/tune$i" ${!v}) > "$out/tune$i.log" 2>&1 &
               pids+=($!); k=$((k + 1))
             done
             child="${pids[*]}"
             for pid in "${pids[@]}"; do wait "$pid" || status=1; done
             for i in 0 1 2 3; do
               [ -f "$out/tune$i.log" ] && grep -h "the tuning chose\|seed spread" "$out/tune$i.log" | sed "s/^/tune$i: /" >> "$dest/summary.txt"
             done
             echo "tunepar: done in $((SECONDS - t0)) s" | tee -a "$dest/summary.txt" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
pack
cat "$out/gpu.txt" >> "$dest/summary.txt"
exit $status
