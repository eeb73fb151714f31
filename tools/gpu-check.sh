#!/usr/bin/env bash
# One batched check on the GPU machine: every staged GPU test, the examples (the engine under
# each policy and with CUDA graphs, two models swapped by sleep and wake, sleep/wake bandwidth
# against pinned copies, NCCL collectives over cudalloc buffers, PyTorch sleep and wake), and
# acceptance programs. Stage first, here (no Rust there):
#
#   ../shared/tools/gpu-stage
#   cargo build --release -p cudalloc-capi && mkdir -p .gpu/lib \
#     && cp target/release/libcudalloc_capi.so .gpu/lib/ && strip .gpu/lib/*.so
#   cp tools/gpu-check.sh .gpu/
#
# then run `bash .gpu/gpu-check.sh [PROGRAMS|none] [MODES]` there with `.gpu` carried. Results
# go to $OUT (logs.tar.gz: tests.txt and one file per example run; acc/); a short summary goes
# to stdout, the tests' part again at the end. Pass `none` (or few programs) to stay under a
# call's limit: the tests and examples take about 3 minutes. BUDGET (seconds, 570) bounds the run.
cd "$(dirname "$0")/.." || exit 1
programs=${1:-side_stream,graph_capture,compile_reduce_overhead,mem_pool,memory_snapshot,generate_kv,train_autocast}
modes=${2:-torch,cudalloc:default,cudalloc:torch,cudalloc:torch-expandable}
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
start=$(date +%s)
ex=.gpu/example
nvidia-smi --query-gpu=name,memory.used,driver_version --format=csv,noheader
timeout 240 bash .gpu/run > "$out/tests.txt" 2>&1
echo "tests rc=$? after $(( $(date +%s) - start )) s"
grep -E "^== |test result|FAILED|panicked" "$out/tests.txt" | head -60
# run NAME SECONDS GREP CMD...: one example, its output in $out/NAME.txt, the lines that matter.
run() {
  local name=$1 secs=$2 pat=$3; shift 3
  timeout "$secs" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$?"
  grep -iE "$pat" "$out/$name.txt" | head -14
}
for p in default torch-expandable torch; do
  run "engine_$p" 90 "tokens/s|identical|device waits|page maps|max rel" $ex/engine --policy "$p"
done
run engine_graphs 120 "^check graphs|^graphs summary" $ex/engine --policy default --graphs
run swap_default 150 "identical|swap|ms|GB/s|error" $ex/swap
run swap_expandable 150 "identical|swap|ms|GB/s|error" $ex/swap --policy torch-expandable
run sleep_bw_default 150 "pinned|cycle|best|error|back" $ex/sleep_bandwidth --gib 8 --policy default
run sleep_bw_expandable 150 "pinned|cycle|best|error|back" $ex/sleep_bandwidth --gib 8 --policy torch-expandable
run collectives 120 "cudalloc|cuMemAlloc|registered|ok|error" $ex/collectives --mib 8,64,256 --iters 20
run sleep_wake_py 180 "identical|back|GB/s|error|Error" env CUDALLOC_LIB=.gpu/lib/libcudalloc_capi.so \
  PYTHONPATH=python python3 python/examples/sleep_wake.py --config large
echo "examples done after $(( $(date +%s) - start )) s"
# A call brings back few files and the last 12,000 characters of output: the logs go back as
# one archive, and the tests' summary is said again at the end, where it is not cut off.
finish() {
  (cd "$out" && tar czf logs.tar.gz ./*.txt && rm -f ./*.txt)
  echo "tests again:"; tar xzOf "$out/logs.tar.gz" ./tests.txt | grep -E "test result|FAILED|panicked" | head -30
  echo "elapsed $(( $(date +%s) - start )) s"
}
if [ "$programs" = none ]; then finish; exit 0; fi
left=$(( ${BUDGET:-570} - ($(date +%s) - start) ))
timeout "$left" python3 python/acceptance/run.py --lib .gpu/lib/libcudalloc_capi.so --out "$out/acc" \
  --timeout 120 --programs "$programs" --modes "$modes" 2>&1 | tail -40
finish
