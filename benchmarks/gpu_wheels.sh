#!/usr/bin/env bash
# Run HERE (a machine with pip access) before a device run: downloads the wheels the GPU machine lacks into .whl/
# (ignored by git; name it in the device tool's `carry`). The GPU image has numpy, scipy, pandas, matplotlib,
# scikit-learn, h5py, formulaic, tqdm, cupy-cuda13x and python 3.12, but not anndata, scanpy, faiss or gpuc itself.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for pkg in anndata scanpy faiss-cpu formulaic-contrasts array-api-compat natsort legacy-api-wrap session-info2 zarr numcodecs donfig crc32c umap-learn pynndescent numba llvmlite igraph texttable; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "$pkg" || echo "could not fetch $pkg"
done
python3 -m pip wheel -q --no-deps -w .whl .   # gpuc itself
du -sh .whl
