#!/usr/bin/env bash
# The one prepared GPU run (device tool): GPU-marked tests, then every benchmarks/gpu_*.py parity + timing script.
# Each script writes its JSON / markdown under $OUT. Usage through the device tool (after benchmarks/gpu_wheels.sh):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-$PWD/gpu_results}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m gpuc.cli info 2>&1 | tee -a "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -15
for script in benchmarks/gpu_*.py; do
  echo "== $script"
  timeout 150 python3 "$script" 2>&1 | tail -40
done
ls -la "$OUT"
