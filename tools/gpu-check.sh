#!/usr/bin/env bash
# One batched check on the GPU machine: every staged GPU test, the example engine under each
# policy, and the acceptance programs. Stage first, here (no Rust there):
#
#   ../shared/tools/gpu-stage
#   cargo build --release -p cudalloc-capi && mkdir -p .gpu/lib \
#     && cp target/release/libcudalloc_capi.so .gpu/lib/ && strip .gpu/lib/*.so
#   cp tools/gpu-check.sh .gpu/
#
# then run `bash .gpu/gpu-check.sh [PROGRAMS] [MODES]` there with `.gpu` carried. Results go to
# $OUT (tests.txt, engine_*.txt, engine_graphs.txt, acc/); a short summary goes to stdout. The whole check takes
# about 6-7 minutes with every program; pass fewer programs to stay under a call's limit.
cd "$(dirname "$0")/.." || exit 1
programs=${1:-side_stream,graph_capture,compile_reduce_overhead,mem_pool,memory_snapshot,generate_kv,train_autocast}
modes=${2:-torch,cudalloc:default,cudalloc:torch,cudalloc:torch-expandable}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,driver_version --format=csv,noheader
timeout 180 bash .gpu/run > "$out/tests.txt" 2>&1
echo "tests rc=$? after $(( $(date +%s) - start )) s"
grep -E "^== |test result|FAILED|panicked" "$out/tests.txt" | head -40
for p in default torch-expandable torch; do
  timeout 90 .gpu/example/engine --policy "$p" > "$out/engine_$p.txt" 2>&1
  echo "engine $p rc=$?"
  grep -iE "tokens/s|identical|device waits|page maps|max rel" "$out/engine_$p.txt" | head -12
done
# CUDA graphs: the decode step captured per batch size into one graph pool (docs/integration.md).
timeout 120 .gpu/example/engine --policy default --graphs > "$out/engine_graphs.txt" 2>&1
echo "engine --graphs rc=$?"
grep -E "^check graphs|^graphs summary" "$out/engine_graphs.txt"
left=$(( 560 - ($(date +%s) - start) ))
timeout "$left" python3 python/acceptance/run.py --lib .gpu/lib/libcudalloc_capi.so --out "$out/acc" \
  --timeout 120 --programs "$programs" --modes "$modes" 2>&1 | tail -40
echo "elapsed $(( $(date +%s) - start )) s"
