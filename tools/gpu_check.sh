#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (issue #33): run it there from the repository root,
#     OUT=/path/to/out tools/gpu_check.sh      (OUT defaults to ./gpu-check-out)
# on the machine's own python3 (torch with CUDA, pytest; no network) with PYTHONPATH=src. In order:
#   1. the CUDA lane (tests/cuda), which holds the launched NCCL job that compiles a graph and must exit 0;
#   2. benchmarks/gpu.py --quick: plain, DTensor, gt eager, gt compiled (with and without CUDA graphs),
#      torch.compile plain and global, at both sizes, with the forward+backward / optimizer split;
#   3. one VERDICT line per goal, also in $OUT/verdicts.txt.
# Each part has a time limit, so that the whole fits in about 6 minutes and a fix and a rerun fit in the
# session's 15. Tables and logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-check-out}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src"     # absolute: launched jobs run elsewhere
mkdir -p "$OUT"

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
    2>&1 | tee "$OUT/device.txt"

timeout 150 "$PY" -m pytest tests/cuda -p no:cacheprovider -rA > "$OUT/cuda_lane.txt" 2>&1
lane=$?
tail -n 3 "$OUT/cuda_lane.txt"

timeout 240 "$PY" benchmarks/gpu.py --quick --json "$OUT/gpu.json" > "$OUT/gpu.txt" 2>&1
bench=$?
grep -v '^VERDICT' "$OUT/gpu.txt" | grep '^|\|^#' | tail -n 30

{
    if [ "$lane" -eq 0 ] && ! grep -q '^SKIPPED' "$OUT/cuda_lane.txt"; then
        echo "VERDICT met the CUDA lane passes"
    else
        echo "VERDICT short the CUDA lane passes (exit $lane, skipped: $(grep -c '^SKIPPED' "$OUT/cuda_lane.txt"); $OUT/cuda_lane.txt)"
    fi
    if grep -q '^PASSED.*test_a_compiled_cuda_process_exits_cleanly' "$OUT/cuda_lane.txt"; then
        echo "VERDICT met the launched compiled NCCL job exits 0"
    else
        echo "VERDICT short the launched compiled NCCL job exits 0 ($OUT/cuda_lane.txt)"
    fi
    if [ "$bench" -eq 0 ]; then grep '^VERDICT' "$OUT/gpu.txt"; else echo "VERDICT short benchmarks/gpu.py (exit $bench, $OUT/gpu.txt)"; fi
} | tee "$OUT/verdicts.txt"
