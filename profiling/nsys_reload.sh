#!/usr/bin/env bash
# Nsight Systems over the ingress benchmark (bench/bench_ingress.py): CUDA API, memcpy, NVTX and
# OS runtime (pread / kvikio threads) on one timeline, for serial, overlap and coordinated reloads.
#   profiling/nsys_reload.sh [OUTDIR] [extra bench_ingress.py args...]
# Writes OUTDIR/reload.nsys-rep and, when the nsys build can export, OUTDIR/reload_stats.txt.
set -euo pipefail
out=${1:-results/nsys}; shift || true
mkdir -p "$out"
cd "$(dirname "$0")/.."
NSYS=${NSYS:-nsys}
command -v "$NSYS" >/dev/null || { echo "nsys not found: set NSYS=/path/to/nsys" >&2; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$NSYS" profile --force-overwrite=true --trace=cuda,nvtx,osrt --cuda-memory-usage=false \
  --output "$out/reload" python3 bench/bench_ingress.py --png "$out/timeline.png" "$@"
"$NSYS" stats --report nvtx_sum,cuda_gpu_mem_time_sum,cuda_gpu_kern_sum --format table \
  "$out/reload.nsys-rep" >"$out/reload_stats.txt" 2>&1 || echo "nsys stats failed; open the .nsys-rep in the GUI" >&2
echo "wrote $out/reload.nsys-rep"
