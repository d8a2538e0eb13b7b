#!/usr/bin/env bash
# Nsight Compute over saria's pack / unpack / checksum kernels (profiling/ncu_driver.py: one launch of
# each on the Qwen3-8B and the hybrid table at 1 and 8 chunks, 12 launches, compiled beforehand).
#   profiling/ncu_kernels.sh [OUTDIR]
# Sections SpeedOfLight, MemoryWorkloadAnalysis, LaunchStats and Occupancy, clocks left as they are.
# Writes OUTDIR/kernels.ncu-rep, OUTDIR/kernels.txt (ncu's details page), OUTDIR/kernels_raw.csv and
# OUTDIR/summary.txt (one line per launch: grid, duration, memory and DRAM throughput, occupancy).
# About 15 s on the lent H200. Exit 2 when ncu cannot be found (PATH, NCU=, /usr/local/cuda*/bin, /opt/nvidia).
set -euo pipefail
out=${1:-results/ncu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
NCU=${NCU:-}
if [ -z "$NCU" ]; then
  NCU=$(command -v ncu || true)
  for candidate in /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
    [ -n "$NCU" ] && break
    [ -x "$candidate" ] && NCU=$candidate
  done
fi
if [ -z "$NCU" ] || ! command -v "$NCU" >/dev/null; then
  echo "ncu_kernels: Nsight Compute (ncu) not found on PATH, under /usr/local/cuda*/bin or /opt/nvidia/nsight-compute;" \
       "set NCU=/path/to/ncu" >&2
  exit 2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET
echo "ncu_kernels: $NCU"
"$NCU" --force-overwrite --target-processes all --profile-from-start off --clock-control none \
  --kernel-name regex:'_copy_pages_kernel|_checksum_kernel' \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
  --export "$out/kernels" "$PY" profiling/ncu_driver.py --labels "$out/launches.json"
"$NCU" --import "$out/kernels.ncu-rep" --page details >"$out/kernels.txt"
"$NCU" --import "$out/kernels.ncu-rep" --page raw --csv >"$out/kernels_raw.csv"
"$PY" - "$out" <<'PYEOF'
import csv, json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = list(csv.reader((out / "kernels_raw.csv").open()))
head = rows[0]
units = rows[1] if len(rows) > 1 and not rows[1][0].strip().isdigit() else [""] * len(head)
data = [r for r in rows[1:] if r and r[0].strip().isdigit()]
labels = json.loads((out / "launches.json").read_text()) if (out / "launches.json").exists() else []
def pick(row, *names):
    for name in names:
        if name in head:
            i = head.index(name)
            unit = units[i].strip() if i < len(units) else ""
            return f"{row[i]} {unit}".strip()
    return "n/a"
lines = [f"{len(data)} kernel launches profiled ({out / 'kernels.ncu-rep'})",
         "launch | kernel | grid | block | duration | memory throughput (% of peak) | DRAM throughput (% of peak) | "
         "DRAM bytes/s | achieved occupancy | registers/thread"]
for n, row in enumerate(data):
    label = labels[n]["label"] if len(labels) == len(data) else f"#{n}"
    lines.append(" | ".join([
        label, pick(row, "Kernel Name"), pick(row, "Grid Size", "launch__grid_size"),
        pick(row, "Block Size", "launch__block_size"), pick(row, "gpu__time_duration.sum"),
        pick(row, "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
        pick(row, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
        pick(row, "dram__bytes.sum.per_second", "dram__bytes_read.sum.per_second"),
        pick(row, "sm__warps_active.avg.pct_of_peak_sustained_active"),
        pick(row, "launch__registers_per_thread")]))
if labels and len(labels) != len(data):
    lines.append(f"(the driver listed {len(labels)} launches, ncu {len(data)}: rows are numbered instead of named)")
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
echo "wrote $out/kernels.ncu-rep, $out/kernels.txt, $out/kernels_raw.csv and $out/summary.txt"
