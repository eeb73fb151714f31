#!/usr/bin/env bash
# Records workloads of python/examples/h200_workloads.py as cudalloc traces on the GPU machine
# (PyTorch's own allocator, memory history on), one process each, into $OUT/traces (with the
# log of each workload that failed). Copy it into .gpu/ and run from there, with `.gpu` carried:
#
#   cp tools/gpu-record.sh .gpu/ ; bash .gpu/gpu-record.sh WORKLOAD...
#
# Each workload gets at most RECORD_TIMEOUT seconds (default 150).
cd "$(dirname "$0")/.." || exit 1
[ $# -gt 0 ] || { echo "usage: $0 WORKLOAD..." >&2; exit 2; }
out=${OUT:-/tmp/gpu-record}/traces
mkdir -p "$out"
for w in "$@"; do
  start=$(date +%s)
  timeout "${RECORD_TIMEOUT:-150}" env PYTHONPATH=python python3 -m cudalloc_trace.record \
    --out "$out/$w.trace.csv.gz" -- python/examples/h200_workloads.py "$w" > "$out/$w.log" 2>&1
  rc=$?
  echo "$w rc=$rc $(( $(date +%s) - start )) s $(du -h "$out/$w.trace.csv.gz" 2>/dev/null | cut -f1)"
  # A call brings back few files: the log stays only when the workload failed.
  if [ $rc = 0 ]; then rm -f "$out/$w.log"; else tail -5 "$out/$w.log"; fi
done
