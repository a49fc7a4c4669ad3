#!/bin/bash
# One GPU-machine session: build, then the named stages, each logged under $OUT
# (default ./gpu_out). Usage: bash bench/gpu_session.sh STAGE... where a stage is
#   build     install this tree (sm_90 only, for speed) into the machine's python3
#   wheels    install the wheels carried in .whl/ (optional dependencies the machine lacks, e.g. torchao)
#   tests     every test marked cuda (TEST_PATHS: only these test files)
#   tests2    (2 GPUs) the scaler's, unscale's and the Trainer's cuda tests, their two-GPU cases included
#   sanitize  compute-sanitizer's four tools over bench/sanitize_driver.py
#   unscale   eager unscale_and_check_ (plain and planned) against torch's kernel
#   zoo       the model zoo at real sizes under AdaptiveMixedPrecision, eager and compiled
#   train     issue 17's targets 5 and 6, bench/zoo_training.py: TRAIN_ARGS="--suite recovery" (the default:
#             planted overflows in GPT-2 small and Llama, fp32 / torch AMP / ours, eager and compiled) or
#             TRAIN_ARGS="--suite alarms" (ordinary training of every zoo family, fp16 and bf16, 2000 steps);
#             one suite per 10-minute call (each stops starting runs after --budget-s, default 540 s: lower it
#             by the build's time when build runs in the same call). Its JSON and table go straight to
#             $OUT/train/, rewritten after every run, so a call cut off at its time limit keeps them.
#   e2e       python -m adaptive_amp bench --suites e2e
#   tune      the measured policy selection on the zoo (bench/tune_evidence.py with TUNE_ARGS)
#   ablation  bf16 weights vs autocast, their compute and update precision separated (bench/precision_ablation.py)
#   parity    eager against compiled: logits, causality, gradients (bench/compile_parity.py, PARITY_ARGS)
#   gap       where a tuned controller's step time goes against its recipe's plain loop (bench/tuned_gap.py,
#             GAP_ARGS, default the compiled Llama 1.1B)
#   guards    what dynamo's hook guards (a controller turns them on after a missed statistics step) cost a
#             compiled forward on this host's CPU (bench/hook_guard_cost.py: host work, the 1.1B Llama's 22 layers
#             at tiny widths)
#   gappar    the gap stage on every GPU at once (GAP_ARGS, or GAP_ARGS_i for GPU i; per-GPU logs and JSON): more
#             rounds in one call's time, or variants side by side. GAP_GPUS="2 3": only those GPUs (each process
#             pinned to its GPU's share of the cores, so other stages can run on the other GPUs and cores)
#   tunepar   up to four bench/tune_evidence.py at once, one a GPU: TUNE_ARGS_0 ... TUNE_ARGS_3 (each set one
#             runs, on GPU i; give each a --max-seconds that leaves the build's time and a margin)
#   examples  examples/ and the README's example on the GPU
#   scaler    GradScaler's per-step overhead against torch's, with 0% and 30% of the parameters frozen
#   multi     (2 GPUs) the scaler's and the integrations' NCCL scripts
# ZOO_ARGS, TRAIN_ARGS, E2E_ARGS and TUNE_ARGS pass options to those stages (a stage must fit a 10-minute call).
# The logs are packed into $OUT/logs.tgz (the device tool brings back at most 8 files), with
# the summary in $OUT/summary.txt. Python runs from /tmp, never from the checkout (the source folder would shadow the install).
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=${OUT:-$repo/gpu_out}
out=$(mktemp -d)
mkdir -p "$dest"
export PYTHONUNBUFFERED=1 ADAPTIVE_AMP_CUDA_ARCHS=${ADAPTIVE_AMP_CUDA_ARCHS:-90} ADAPTIVE_AMP_CUDA=1
status=0
pack() {  # the logs so far into $dest (also when the call's time limit stops this script)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
  date -u >> "$out/gpu.txt"
  tar czf "$dest/logs.tgz" -C "$out" .
}
smi=
smi_log() {  # every GPU's clocks, power and throttle reasons each half second, in the background (pid in $smi)
  local q=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active
  nvidia-smi --query-gpu=$q --format=csv > /dev/null 2>&1 || q=${q%,*}  # (older drivers lack the reasons)
  nvidia-smi --query-gpu=$q --format=csv -lms 500 > "$1" 2>&1 &
  smi=$!
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
    sanitize) run sanitize bash "$repo/bench/sanitize.sh" "$out" ;;
    unscale) run unscale python3 "$repo/bench/bench_unscale.py" --eager --json "$out/unscale_eager.json" ;;
    zoo) run zoo python3 "$repo/bench/zoo_gpu.py" --out "$out/zoo" ${ZOO_ARGS:-} ;;
    train) run train python3 "$repo/bench/zoo_training.py" --out "$dest/train" ${TRAIN_ARGS:---suite recovery} ;;
    e2e) run e2e python3 -m adaptive_amp bench --suites e2e --no-unscale --json "$out/e2e.json" ${E2E_ARGS:-} ;;
    multi) run multi_gpu torchrun --standalone --nproc_per_node=2 "$repo/bench/multi_gpu.py" --out "$out/mg"
           run multi_gpu_integrations torchrun --standalone --nproc_per_node=2 "$repo/bench/multi_gpu_integrations.py" \
               --backend nccl --device cuda --out "$out/mgi" --timeout 120 ;;
    examples) run examples python3 -m pytest "$repo/tests/test_examples.py" "$repo/tests/test_readme.py" -q -p no:cacheprovider ;;
    scaler) run scaler python3 -m adaptive_amp bench --no-unscale --scaler --scaler-frozen 0 0.3 --json "$out/scaler.json" ;;
    tune) run tune python3 "$repo/bench/tune_evidence.py" --out "$out/tune" ${TUNE_ARGS:-} ;;
    ablation) run ablation python3 "$repo/bench/precision_ablation.py" --out "$out/ablation" ${ABLATION_ARGS:-} ;;
    parity) run parity python3 "$repo/bench/compile_parity.py" --out "$out/parity.json" ${PARITY_ARGS:-} ;;
    gap) smi_log "$out/gap_clocks.csv"
         run gap python3 "$repo/bench/tuned_gap.py" --json "$out/gap.json" ${GAP_ARGS:---compiled}
         kill "$smi" 2> /dev/null ;;
    guards) run guards python3 "$repo/bench/hook_guard_cost.py" --json "$out/guards.json" ${GUARDS_ARGS:-} ;;
    gappar) smi_log "$out/gap_clocks.csv"; pids=(); t0=$SECONDS
            n=$(nvidia-smi -L | wc -l); per=$(( $(nproc) / n )); gpus=${GAP_GPUS:-$(seq 0 $((n - 1)))}
            for i in $gpus; do
              pin=(); command -v taskset > /dev/null && pin=(taskset -c "$((i * per))-$((i * per + per - 1))")
              v="GAP_ARGS_$i"
              (cd /tmp && CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$per exec "${pin[@]}" python3 \
                  "$repo/bench/tuned_gap.py" --json "$out/gap$i.json" ${!v:-${GAP_ARGS:---compiled}}) > "$out/gap$i.log" 2>&1 &
              pids+=($!)
            done
            child="${pids[*]}"
            for pid in "${pids[@]}"; do wait "$pid" || status=1; done
            kill "$smi" 2> /dev/null
            for i in $gpus; do
              grep -h "against the plain loop" "$out/gap$i.log" | sed "s/^/gap$i: /" >> "$dest/summary.txt"
            done
            echo "gappar: GPUs" $gpus", done in $((SECONDS - t0)) s" | tee -a "$dest/summary.txt"
            pack ;;
    tunepar) pids=(); t0=$SECONDS; n=0
             for i in 0 1 2 3; do v="TUNE_ARGS_$i"; [ -n "${!v:-}" ] && n=$((n + 1)); done
             # Each process gets its own share of the cores (and inductor as many compile workers): eager steps
             # are host-bound, and another process's compile workers would slow them.
             per=$(( $(nproc) / (n > 0 ? n : 1) )); k=0
             for i in 0 1 2 3; do
               v="TUNE_ARGS_$i"; [ -n "${!v:-}" ] || continue
               pin=(); command -v taskset > /dev/null && pin=(taskset -c "$((k * per))-$((k * per + per - 1))")
               (cd /tmp && CUDA_VISIBLE_DEVICES=$i TORCHINDUCTOR_COMPILE_THREADS=$per exec "${pin[@]}" python3 \
                   "$repo/bench/tune_evidence.py" --out "$out/tune$i" ${!v}) > "$out/tune$i.log" 2>&1 &
               pids+=($!); k=$((k + 1))
             done
             child="${pids[*]}"
             for pid in "${pids[@]}"; do wait "$pid" || status=1; done
             for i in 0 1 2 3; do
               [ -f "$out/tune$i.log" ] && grep -h "targets:" "$out/tune$i.log" | sed "s/^/tune$i: /" >> "$dest/summary.txt"
             done
             echo "tunepar: done in $((SECONDS - t0)) s" | tee -a "$dest/summary.txt" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
pack
cat "$out/gpu.txt" >> "$dest/summary.txt"
exit $status
