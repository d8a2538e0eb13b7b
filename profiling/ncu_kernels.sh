#!/usr/bin/env bash
# Nsight Compute over saria's pack / unpack / checksum kernels on the Qwen3-8B table.
#   profiling/ncu_kernels.sh [OUTDIR]
# Profiles a few launches of each kernel with the memory-workload sections; writes OUTDIR/kernels.ncu-rep
# and a text summary.
set -euo pipefail
out=${1:-results/ncu}
mkdir -p "$out"
cd "$(dirname "$0")/.."
NCU=${NCU:-ncu}
command -v "$NCU" >/dev/null || { echo "ncu not found: set NCU=/path/to/ncu" >&2; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$NCU" --force-overwrite --target-processes all \
  --kernel-name regex:'_copy_pages_kernel|_checksum_kernel' --launch-count 6 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
  --export "$out/kernels" python3 bench/bench_kernels.py --chunks 8 --csv "$out/bench_kernels.csv"
"$NCU" --import "$out/kernels.ncu-rep" --page details >"$out/kernels.txt"
echo "wrote $out/kernels.ncu-rep and $out/kernels.txt"
