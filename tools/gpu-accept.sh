#!/usr/bin/env bash
# The PyTorch checks on the GPU machine, without the Rust tests: the wheel installed for the
# machine's Python (into a folder of its own) and used from there, then acceptance programs
# from the tree. Stage here first:
#
#   cargo build --release -p cudalloc-capi -p cudalloc-cli
#   mkdir -p .gpu/lib .gpu/cli .gpu/whl && cp target/release/libcudalloc_capi.so .gpu/lib/ \
#     && cp target/release/cudalloc .gpu/cli/ && strip .gpu/lib/*.so .gpu/cli/cudalloc
#   python3 -m pip wheel . --no-deps -w .gpu/whl ; cp tools/gpu-accept.sh .gpu/
#
# then run `bash .gpu/gpu-accept.sh PROGRAMS MODES [run.py options, e.g. --repeat 3 --cpus 2,3]`
# there with `.gpu` carried; the table and the log go to $OUT/acc.
cd "$(dirname "$0")/.." || exit 1
programs=${1:?programs}
modes=${2:-torch,torch-expandable,cudalloc:default,cudalloc:torch-expandable,cudalloc:torch}
shift 2 || shift $#
out=${OUT:-/tmp/gpu-accept}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.used,driver_version --format=csv,noheader
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
if ls .gpu/whl/*.whl >/dev/null 2>&1; then
  # Installed into a folder of its own (a venv would not see a torch installed for the user).
  site=/tmp/cudalloc-site
  rm -rf "$site" && python3 -m pip install -q --no-deps --no-index --target "$site" .gpu/whl/*.whl \
    && (cd /tmp && PYTHONPATH=$site python3 -c "
import torch, cudalloc_torch
cudalloc_torch.enable()
x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize()
print('installed:', cudalloc_torch.__file__, 'backend', cudalloc_torch.backend(), 'sum', float(x.sum()))
print('reserved by cudalloc', torch.cuda.memory_reserved())
" && PYTHONPATH=$site "$site/bin/cudalloc" replay --policy torch "$OLDPWD/traces/bert_dynamic.trace.csv.gz" | tail -3) \
    || echo "WHEEL CHECK FAILED"
  echo "wheel check after $(( $(date +%s) - start )) s"
fi
export CUDALLOC_CLI=$PWD/.gpu/cli/cudalloc
left=$(( 570 - ($(date +%s) - start) ))
timeout "$left" python3 python/acceptance/run.py --lib .gpu/lib/libcudalloc_capi.so --out "$out/acc" \
  --timeout 150 --programs "$programs" --modes "$modes" "$@" 2>&1 | tail -60
echo "elapsed $(( $(date +%s) - start )) s"
