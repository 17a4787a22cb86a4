#!/usr/bin/env bash
# Run HERE (a machine with the package registry) before a device run: puts into .whl/ (ignored by git; name it in
# the device tool's `carry`, at most 64 MiB) the Python 3.12 wheels the GPU machine lacks. The GPU image has Python
# 3.12 with numpy, scipy, pandas, matplotlib, scikit-learn, h5py, formulaic, tqdm, pytest, cupy-cuda13x, numba 0.68
# with llvmlite, numba-cuda and PyTorch (and their dependencies), but not anndata, scanpy, dask or gpuc; gpuc itself
# runs from src/ (gpu_check.sh sets PYTHONPATH). numba and llvmlite must not be carried: the carried wheels come first
# on PYTHONPATH and would shadow the image's numba, which numba-cuda is built against.
# Left out to stay under 64 MiB: faiss-cpu (the CPU side of the check then uses gpuc's exact blocked kNN, the GPU
# algorithm run with numpy) and what scanpy imports only for plots or other tools (statsmodels, seaborn, umap...).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude_file="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude_file" 2>/dev/null || echo '/.whl/' >>"$exclude_file"
rm -rf .whl
tmp="$(mktemp -d)"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$tmp" \
  anndata scanpy formulaic-contrasts session-info2 array-api-compat
# already on the GPU image, or not needed by the check
skip='^(numpy|scipy|pandas|matplotlib|scikit_learn|h5py|formulaic|tqdm|cupy.*|numba|numba_cuda|llvmlite|fastrlock|pillow|fonttools|kiwisolver|contourpy|cycler|pyparsing|python_dateutil|six|pytz|tzdata|packaging|joblib|threadpoolctl|interface_meta|wrapt|typing_extensions|narwhals|faiss_cpu|statsmodels|seaborn|patsy|networkx|umap_learn|pynndescent|igraph|texttable|leidenalg|dask|distributed|cloudpickle|toolz|partd|locket|fsspec|pyyaml|importlib_metadata|zipp)-'
mkdir -p .whl
for w in "$tmp"/*.whl; do
  base="$(basename "$w")"
  if ! echo "$base" | tr 'A-Z' 'a-z' | grep -qE "$skip"; then cp "$w" .whl/; fi
done
rm -rf "$tmp"
# the Dask stage (benchmarks/gpu_dask.py): dask, distributed and dask-cuda with what they need that the image lacks
# (dask-cuda pins its dask through rapids-dask-dependency; left out to stay under 64 MiB: bokeh, the dashboard, and
# cuda-core, 6.6 MB; without it gpu_dask.py falls back to a LocalCluster with one GPU per worker process)
tmp="$(mktemp -d)"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$tmp" dask-cuda
skip_dask='^(numpy|pandas|numba|numba_cuda|llvmlite|pillow|contourpy|bokeh|narwhals|xyzservices|packaging|python_dateutil|tzdata|cupy.*|fastrlock|cuda_core|cuda_pathfinder)-'
for w in "$tmp"/*.whl; do
  base="$(basename "$w")"
  if ! echo "$base" | tr 'A-Z' 'a-z' | grep -qE "$skip_dask"; then cp "$w" .whl/; fi
done
rm -rf "$tmp"
ls .whl
# the device tool carries at most 64 MiB; numba/llvmlite must never be among them (see above)
if ls .whl | tr 'A-Z' 'a-z' | grep -qE '^(numba|llvmlite)-'; then
  echo "error: numba or llvmlite wheels in .whl/ would shadow the GPU image's numba" >&2
  exit 1
fi
size_kib=$(du -sk .whl | cut -f1)
echo "$((size_kib / 1024)) MiB in .whl/ (limit 64 MiB)"
if [ "$size_kib" -gt $((64 * 1024)) ]; then
  echo "error: .whl/ is over the device tool's 64 MiB carry limit" >&2
  exit 1
fi
