#!/bin/bash
# Run compute-sanitizer's four tools over tools/sanitize_driver.py, restricted
# to adaptive_amp's kernels. Usage: bash tools/sanitize.sh [OUTDIR [TOOL...]]
# (default: all four tools)
# Needs a GPU machine whose runtime lets compute-sanitizer attach (not gVisor).
out=${1:-.}
here=$(cd "$(dirname "$0")" && pwd)
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
filter="kns=aamp"  # every kernel of ours lives in namespace aamp
status=0
tools=("${@:2}")
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck initcheck synccheck)
for tool in "${tools[@]}"; do
  # initcheck must see every kernel: memory that torch's (unchecked) kernels
  # wrote would otherwise count as never written.
  args=(--tool "$tool" --error-exitcode 3)
  [ "$tool" = initcheck ] || args+=(--kernel-name "$filter")
  timeout 600 "$cs" "${args[@]}" python3 "$here/sanitize_driver.py" > "$out/sanitize_$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|hazard' "$out/sanitize_$tool.log" | tail -1)"
  [ $rc -eq 0 ] || status=1
done
exit $status
