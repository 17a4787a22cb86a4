"""A fresh process loads gpuc's numba kernels from numba's disk cache instead of compiling them again.

Two processes run the same small consensus NMF, metacells and DESeq2 fits with ``NUMBA_CACHE_DIR`` set to an empty
folder. The first compiles the kernels it calls (cache misses); the second must load every kernel it calls from the
cache (hits, no misses). A kernel whose cache key changes from process to process (e.g. a function built inside
another function that captures a dispatcher) would miss in both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

KERNEL_MODULES = (
    "gpuc.nmf._kernels_cpu",
    "gpuc.metacells._kernels_cpu",
    "gpuc.deseq._kernels_cpu",
    "gpuc.deseq._fitdisp",
)

# the kernels the fits below call from Python (kernels called only from other kernels are linked into their caller's
# cached code and are not loaded on their own)
CALLED = {
    "gpuc.nmf._kernels_cpu": {"spectra_half", "usage_half", "sweep"},
    "gpuc.metacells._kernels_cpu": {
        "fw_a_block",
        "fw_b_update",
        "chunk_buckets",
        "col_argmin_diff",
        "csr_times_dense",
        "csr_matmat",
        "frank_wolfe_columns",
    },
    "gpuc.deseq._kernels_cpu": {"irls", "nb_const"},
    "gpuc.deseq._fitdisp": {"fit_disp_cpu", "fit_disp_grid_cpu"},
}

SCRIPT = f"""
import importlib, json, warnings

import numpy as np
import scanpy as sc
import scipy.sparse as sp
from anndata import AnnData
from numba.core.registry import CPUDispatcher

import gpuc

warnings.simplefilter("ignore")
gpuc.settings.progress = False
rng = np.random.default_rng(0)
counts = sp.random(150, 60, density=0.3, random_state=rng, data_rvs=lambda n: rng.poisson(3.0, n) + 1.0).tocsr()
nmf = AnnData(counts.astype(np.float32))
gpuc.tl.consensus_nmf(nmf, 3, n_runs=4, mask_var=None, density_threshold=2.0, device="cpu")  # sparse: fused
nmf.X = counts.toarray()
gpuc.tl.consensus_nmf(nmf, 3, n_runs=4, mask_var=None, density_threshold=2.0, device="cpu")  # dense: sweep
gpuc.tl.metacells(sc.datasets.pbmc68k_reduced(), 9, max_iter=12, device="cpu")
pb = gpuc.datasets.pasilla()[:, :1500].copy()
gpuc.tl.deseq(pb, "~condition", contrast=["condition", "treated", "untreated"], device="cpu")

stats = {{}}
for name in {KERNEL_MODULES!r}:
    mod = importlib.import_module(name)
    for attr, obj in vars(mod).items():
        if isinstance(obj, CPUDispatcher):
            s = obj.stats
            stats[name + "." + attr] = [sum(s.cache_hits.values()), sum(s.cache_misses.values())]
print(json.dumps(stats))
"""


def _run(cache_dir: str) -> dict[str, list[int]]:
    env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # compiles every kernel from an empty cache in a fresh process: ~1-2 min on 2 cores
def test_second_process_loads_kernels_from_cache(tmp_path):
    cache_dir = str(tmp_path / "numba_cache")
    first = _run(cache_dir)
    second = _run(cache_dir)
    called = {f"{mod}.{name}" for mod, names in CALLED.items() for name in names}
    assert called <= first.keys()
    for name in sorted(called):
        assert first[name][1] > 0, f"{name} was not compiled in the first process: {first[name]}"
    for name, (hits, misses) in sorted(second.items()):
        assert misses == 0, f"{name} was compiled again in a fresh process ({misses} cache misses)"
        if name in called:
            assert hits > 0, f"{name} was not loaded from the cache"
