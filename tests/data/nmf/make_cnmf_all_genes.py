"""Make ``cnmf_k7_all_genes.npz``: cNMF 1.7.1's all-gene outputs at k=7, density thresholds 0.5 and 2.0.

Not run by the tests (they read the .npz); kept beside it so the reference can be regenerated. Needs ``cnmf==1.7.1``
(its own venv: ``python -m venv v && v/bin/pip install cnmf==1.7.1``), and the counts rebuilt from scanpy's
pbmc68k_reduced (``pbmc68k_reduced_counts_765g.h5ad``, in the shared data folder ``cnmf_ref/``; recipe in its
``uns['note']``: ``round(expm1(raw.X) * n_counts / 1e4)``)::

    python make_cnmf_all_genes.py path/to/pbmc68k_reduced_counts_765g.h5ad

What is stored (arrays only, no pickle):

- ``data``, ``indices``, ``indptr``, ``shape``, ``cells``, ``genes``: the 700 x 765 integer counts (CSR), the input of
  ``prepare``; ``hvgs``: the 500 genes cNMF factorised (``num_highvar_genes=500``), in its order.
- for ``dt`` in ``0_5`` and ``2_0`` (``consensus(7, density_threshold=0.5 | 2.0)``):

  - ``dt{dt}_median_spectra``: the consensus spectra over the HVGs (7 x 500, rows sum to 1; cNMF's
    ``consensus_spectra`` file, ``cnmf.k_7.dt_{dt}.spectra``);
  - ``dt{dt}_usages_consensus``: the usages refitted on the factorised matrix against those spectra (700 x 7; the
    usages file of ``consensus(..., refit_usage=False)``), on which the scores are regressed;
  - ``dt{dt}_usages``: the final usages (700 x 7; the usages file of the default ``refit_usage=True``: refitted on the
    SD-scaled TPM of the HVGs against the TPM spectra);
  - ``dt{dt}_gene_spectra_tpm``, ``dt{dt}_gene_spectra_score``: ``gene_spectra_tpm`` and ``gene_spectra_score``
    over all 765 genes (7 x 765).

Programmes are in cNMF's order (by total normalised usage), the same in every array of a threshold.
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp
from cnmf import cNMF
from cnmf.cnmf import load_df_from_npz

K = 7
N_ITER = 20
SEED = 14
N_HVG = 500
THRESHOLDS = (0.5, 2.0)


def main(counts_fn: str, out_fn: str) -> None:
    counts = sc.read_h5ad(counts_fn)
    x = sp.csr_matrix(counts.X)
    out: dict[str, np.ndarray] = {
        "data": x.data.astype(np.float32),
        "indices": x.indices.astype(np.int32),
        "indptr": x.indptr.astype(np.int64),
        "shape": np.asarray(x.shape, dtype=np.int64),
        "cells": np.asarray(counts.obs_names, dtype=str),
        "genes": np.asarray(counts.var_names, dtype=str),
    }
    with tempfile.TemporaryDirectory() as tmp:
        obj = cNMF(output_dir=tmp, name="pbmc68k")
        obj.prepare(counts_fn=counts_fn, components=[K], n_iter=N_ITER, seed=SEED, num_highvar_genes=N_HVG)
        obj.factorize(worker_i=0, total_workers=1)
        obj.combine()
        out["hvgs"] = np.asarray(open(obj.paths["nmf_genes_list"]).read().split("\n"), dtype=str)
        for dt in THRESHOLDS:
            tag = str(dt).replace(".", "_")

            def read(path: str, tag: str = tag) -> pd.DataFrame:
                return load_df_from_npz(path % (K, tag))

            # refit_usage=False first: its usages are the consensus refit the scores are regressed on
            obj.consensus(K, density_threshold=dt, show_clustering=False, build_ref=False, refit_usage=False)
            usages_consensus = read(obj.paths["consensus_usages"])
            obj.consensus(K, density_threshold=dt, show_clustering=False, build_ref=False)
            spectra = read(obj.paths["consensus_spectra"])
            assert list(spectra.columns) == list(out["hvgs"])
            tpm = read(obj.paths["gene_spectra_tpm"])
            score = read(obj.paths["gene_spectra_score"])
            assert list(tpm.columns) == list(out["genes"]) and list(score.columns) == list(out["genes"])
            usages = read(obj.paths["consensus_usages"])
            assert list(usages.index) == list(out["cells"])
            out[f"dt{tag}_median_spectra"] = spectra.to_numpy(np.float64)
            out[f"dt{tag}_usages_consensus"] = usages_consensus.to_numpy(np.float64)
            out[f"dt{tag}_usages"] = usages.to_numpy(np.float64)
            out[f"dt{tag}_gene_spectra_tpm"] = tpm.to_numpy(np.float64)
            out[f"dt{tag}_gene_spectra_score"] = score.to_numpy(np.float64)
    np.savez_compressed(out_fn, **out)
    print(f"wrote {out_fn} ({os.path.getsize(out_fn) / 1e3:.0f} kB)")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "cnmf_k7_all_genes.npz"))
