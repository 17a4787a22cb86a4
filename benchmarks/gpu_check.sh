#!/usr/bin/env bash
# The one prepared GPU run, for a fresh device machine (Python 3.12 and CuPy for CUDA 13, no package registry):
# GPU = CPU parity and timings of the three tools, pbmc3k on the device through every tool, the gpu-marked tests,
# the tools' units on a dask-cuda cluster (one GPU per worker), then a summary with the targets. Stages run in order of importance, each under its own time limit and a shared
# deadline, so that a failure or a timeout in one still leaves the others' results under $OUT.
#
# Prepare HERE (with a registry):  bash benchmarks/gpu_wheels.sh        (wheels into .whl/, at most 64 MiB)
# Run through the device tool:     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=500)
# Results: $OUT/{deseq,nmf,metacells,rsc,dask}_gpu.{json,md}, pytest_gpu.txt, gpu.txt, stage_status.txt, summary.md/json
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/gpu_results}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
mkdir -p "$OUT"
DEADLINE=${GPUC_CHECK_SECONDS:-465}  # the whole run stays under 8 minutes, wheels included
status_file="$OUT/stage_status.txt"
: >"$status_file"

if [ -d .whl ]; then  # the wheels the machine lacks (gpu_wheels.sh: numba 0.61, which needs numpy <= 2.2); gpuc runs from src/
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >"$OUT/pip.txt" 2>&1 || echo "wheel install failed (see pip.txt)" | tee -a "$status_file"
fi
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"

# stage NAME MAX_SECONDS COMMAND...: run under min(MAX, time left before the deadline); log to $OUT/NAME.log
stage() {
  local name=$1 max=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((max < left ? max : left))
  if [ "$limit" -lt 10 ]; then
    echo "$name: skipped (deadline reached)" | tee -a "$status_file"
    return
  fi
  local start=$SECONDS
  echo "== $name (limit ${limit} s)"
  timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -25 "$OUT/$name.log"
  echo "$name: exit $rc, $((SECONDS - start)) s$([ $rc -eq 124 ] && echo ' (timed out)')" | tee -a "$status_file"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -m gpuc.cli info; python3 -c 'import numpy, numba, scanpy; print("numpy", numpy.__version__, "numba", numba.__version__, "scanpy", scanpy.__version__)'; } >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
stage deseq 60 python3 benchmarks/gpu_deseq.py
stage nmf 90 python3 benchmarks/gpu_nmf.py
stage metacells 150 python3 benchmarks/gpu_metacells.py
stage rsc 90 python3 benchmarks/gpu_rsc.py
stage pytest_gpu 80 python3 -m pytest -q -m gpu tests -p no:cacheprovider -x --no-header
stage dask_gpu 90 python3 benchmarks/gpu_dask.py
python3 benchmarks/gpu_summary.py >/dev/null 2>&1 || echo "summary failed" >>"$status_file"
cat "$OUT/summary.md" 2>/dev/null
echo "total: $SECONDS s"
ls -la "$OUT"
