#!/usr/bin/env bash
# The one prepared GPU run, for a fresh device machine (Python 3.12, CuPy for CUDA 13, numba 0.68 and numba-cuda; no
# package registry): first the cold-run stage (`_harness.py cold`: fills the kernel caches and times a fresh process's
# first calls), then GPU = CPU parity and timings of the three tools (gpu_<tool>.py), gpuc's CPU path at 1/4/16
# threads (bench_<tool>.py --skip-peers), pbmc3k on the device through every tool, the gpu-marked tests, the tools'
# units on a dask-cuda cluster; then ONE summary (targets, crossover, warm-up, CPU scaling, parity) and ONE archive of
# every log and stage file. Stages run in order of importance, each
# under its own time limit and a shared deadline, so that a failure or a timeout in one still leaves the others'
# results.
#
# Prepare HERE (with a registry):  bash benchmarks/gpu_wheels.sh        (wheels into .whl/, at most 64 MiB)
# Run through the device tool:     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Results under $OUT: summary.md and summary.json (gpu_summary.py), logs.tar.gz (every stage's log and files:
# warmup, deseq_gpu, nmf_gpu, metacells_gpu, cpu_metacells, cpu_nmf, cpu_deseq, rsc_gpu, dask_gpu .json/.md,
# pytest_gpu.log, gpu.txt, stage_status.txt); GPUC_CHECK_KEEP_FILES=1 also leaves the loose files beside the archive.
#
# Smoke mode (GPUC_SMOKE=1, no GPU needed): every stage runs its script's smoke mode (tiny data on gpuc's stand-in
# GPU; the CPU stages on tiny cases), the gpu-marked tests are skipped; tests/core/test_gpu_check_smoke.py runs it.
#
# Sized for about 8.5 minutes on a fresh H200 machine: the stages' limits add up to more than the deadline
# (GPUC_CHECK_SECONDS, default 500 s for the stages; the summary and the archive follow it), so a stage that runs
# long takes time from the least important ones at the end, which are then skipped and say so.
# Without a usable GPU (and outside smoke mode) the GPU stages are skipped at once (GPUC_CHECK_FORCE_GPU_STAGES=1 runs
# them anyway, to see them fail fast); the CPU scaling stages still run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"  # the interpreter of every stage (PYTHON=... for a virtual environment)
export OUT="${OUT:-$PWD/gpu_results}" PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# kernel caches under the working tree (benchmarks/_work/ is git-ignored), shared by every stage's processes: the
# warm-up stage compiles, the others load
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-$PWD/benchmarks/_work/gpu_cache/cupy}"
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-$PWD/benchmarks/_work/gpu_cache/numba}"
mkdir -p "$OUT" "$CUPY_CACHE_DIR" "$NUMBA_CACHE_DIR"
smoke="${GPUC_SMOKE:-0}"
# smoke mode runs on whatever machine is at hand (a loaded 2-core CI runner): its stages' limits and the deadline are
# GPUC_CHECK_LIMIT_SCALE (default 4) times the device run's
scale=1
[ "$smoke" = 1 ] && scale=${GPUC_CHECK_LIMIT_SCALE:-4}
DEADLINE=${GPUC_CHECK_SECONDS:-$((500 * scale))}
status_file="$OUT/stage_status.txt"
: >"$status_file"

# the wheels the image lacks (gpu_wheels.sh: anndata, scanpy, dask, dask-cuda...; never numba), made for Python 3.12
site="${GPUC_CHECK_SITE:-/tmp/site}"
if [ -d .whl ] && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)" | tee -a "$status_file"
  export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
else
  [ -d .whl ] && echo "wheels in .whl/ are for Python 3.12, this is $("$PY" -V): not installed" | tee -a "$status_file"
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: none"
  echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
  git rev-parse HEAD 2>/dev/null | sed 's/^/commit /'
  "$PY" -m gpuc.cli info
  "$PY" - <<'EOF'
import importlib.metadata as md, platform
names = ("numpy", "scipy", "numba", "numba-cuda", "llvmlite", "cupy-cuda13x", "anndata", "scanpy", "dask", "dask-cuda")
vers = []
for n in names:
    try:
        vers.append(f"{n} {md.version(n)}")
    except md.PackageNotFoundError:
        vers.append(f"{n} -")
print("python", platform.python_version(), "|", ", ".join(vers))
import numba
print("numba imported from", numba.__file__)
EOF
} >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if [ "$smoke" = 1 ] || [ "${GPUC_CHECK_FORCE_GPU_STAGES:-0}" = 1 ] \
  || "$PY" -c 'import sys, cupy; sys.exit(0 if cupy.cuda.runtime.getDeviceCount() > 0 else 1)' >/dev/null 2>&1; then
  have_gpu=1
else
  have_gpu=0
  echo "no usable GPU (cupy does not import or sees no device): GPU stages skipped" | tee -a "$status_file"
fi

# the fused kernels (numba-cuda) must be on: a GPU run that silently times the CuPy array code instead measures the
# wrong thing (issue 40: numba-cuda 0.30 under numpy 2.5 before gpuc._numpy_compat). `gpuc info --require-fused`
# prints the status line and exits 3 when they are off; on a GPU that stops the run here. Smoke mode runs on a machine
# whose numba-cuda may lack the CUDA compiler libraries (the stand-in runs the kernels under the simulator): it only
# reports the line.
fused_line="$(grep -m1 '^fused GPU kernels' "$OUT/gpu.txt" || echo 'fused GPU kernels: status line missing')"
echo "$fused_line" | tee -a "$status_file"
if [ "$have_gpu" = 1 ] && [ "$smoke" != 1 ] && ! "$PY" -m gpuc.cli info --require-fused >/dev/null 2>"$OUT/fused.err"; then
  echo "ERROR: gpuc's fused GPU kernels are off on this GPU machine; stopping (see gpu.txt; GPUC_CHECK_ALLOW_UNFUSED=1 runs anyway)" \
    | tee -a "$status_file"
  [ "${GPUC_CHECK_ALLOW_UNFUSED:-0}" = 1 ] || exit 3
fi

# stage NAME MAX_SECONDS COMMAND...: run under min(MAX, time left before the deadline), with GPUC_STAGE_SECONDS set to
# that limit (scripts with an internal time budget size it from it); log to $OUT/NAME.log
stage() {
  local name=$1 max=$(($2 * scale))
  shift 2
  local left=$((DEADLINE - SECONDS))
  local limit=$((max < left ? max : left))
  if [ "$limit" -lt 15 ]; then
    echo "$name: skipped (deadline reached)" | tee -a "$status_file"
    return
  fi
  local start=$SECONDS
  echo "== $name (limit ${limit} s)"
  GPUC_STAGE_SECONDS=$limit timeout --kill-after=5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -8 "$OUT/$name.log"
  echo "$name: exit $rc, $((SECONDS - start)) s$([ $rc -eq 124 ] && echo ' (timed out)')" | tee -a "$status_file"
}
gpu_stage() {
  if [ "$have_gpu" = 1 ]; then stage "$@"; else echo "$1: skipped (no usable GPU)" | tee -a "$status_file"; fi
}

# gpuc's CPU path at 1, 4 and 16 threads (those the machine has; issue 32): bench_<tool>.py without its peer, one
# fresh process per thread count, the first call and one warm call each, the caches filled by the cold-run stage;
# metacells 6,881 cells, NMF 6,881 x 2,000 k=7 x 20, DESeq2 500 x 30,000
cpu_stage() {
  local tool=$1 limit=$2 case=$3
  stage "cpu_$tool" "$limit" "$PY" "benchmarks/bench_$tool.py" --cases "$case" --cores 1,4,16 --skip-peers \
    --no-default --repeats 1 --warm-calls 1 --no-fill --budget $((limit * scale - 10)) --out "$OUT"
}

gpu_stage warmup 130 "$PY" benchmarks/_harness.py cold
# the fused kernels one by one: CUDA-event times of one HALS iteration, a metacells B-step, a DESeq2 Newton pass, host
# µs per launch (new views vs a kernel session), SpMM vs GEMM at 6,881 x 2,000, each beside the CPU path (issue 40)
gpu_stage kernels 80 "$PY" benchmarks/gpu_kernels.py
gpu_stage deseq 60 "$PY" benchmarks/gpu_deseq.py
gpu_stage nmf 75 "$PY" benchmarks/gpu_nmf.py
gpu_stage metacells 100 "$PY" benchmarks/gpu_metacells.py
cpu_stage metacells 55 cd34like
cpu_stage nmf 45 k7
cpu_stage deseq 50 500x30000
gpu_stage rsc 50 "$PY" benchmarks/gpu_rsc.py
if [ "$smoke" = 1 ]; then
  echo "pytest_gpu: skipped (smoke mode)" | tee -a "$status_file"
else
  gpu_stage pytest_gpu 45 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider -x --no-header
fi
gpu_stage dask_gpu 60 "$PY" benchmarks/gpu_dask.py
echo "stages done: $SECONDS s" | tee -a "$status_file"

"$PY" benchmarks/gpu_summary.py >"$OUT/summary.log" 2>&1 || echo "summary failed (see summary.log)" | tee -a "$status_file"
cat "$OUT/summary.md" 2>/dev/null

# one archive of everything but the summary; the loose files go once it reads back
(
  cd "$OUT" || exit 1
  mapfile -t files < <(find . -mindepth 1 -maxdepth 1 ! -name summary.md ! -name summary.json ! -name logs.tar.gz -printf '%P\n' | sort)
  if [ "${#files[@]}" -gt 0 ] && tar -czf logs.tar.gz "${files[@]}" && tar -tzf logs.tar.gz >/dev/null; then
    [ "${GPUC_CHECK_KEEP_FILES:-0}" = 1 ] || rm -rf "${files[@]}"
  else
    echo "archive failed: the loose files stay"
  fi
)

# the crossover and the targets again, last, where the device tool's output tail keeps them
awk '/^## Crossover/{p=1} /^## Warm-up/{p=0} p' "$OUT/summary.md" 2>/dev/null
awk '/^## Targets/{p=1} /^## Crossover/{p=0} p' "$OUT/summary.md" 2>/dev/null
echo "total: $SECONDS s"
ls -la "$OUT"
