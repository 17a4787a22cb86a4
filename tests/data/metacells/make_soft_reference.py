"""Reference outputs of SEACells 0.3.3's own functions on a gpuc metacell run (soft summaries and assignment QC).

Run in a virtual environment with gpuc and the reference (offline afterwards; the tests never import SEACells)::

    python3 -m venv venv-seacells && venv-seacells/bin/pip install -e . seacells==0.3.3 ipywidgets
    venv-seacells/bin/python tests/data/metacells/make_soft_reference.py

Input: scanpy's ``pbmc68k_reduced`` (700 cells, ``X_pca``, ``bulk_labels``), metacells by
``gpuc.tl.metacells(n_metacells=40, device="cpu", random_state=0)`` (40 metacells, so that some cells spread their
weight thinly enough for SEACells' 95th-percentile fallback to apply), and the 700 x 500 integer count matrix of
``tests/data/nmf/pbmc68k_counts_700x500.npz`` (same cells).

Writes, beside this script:

``pbmc68k_gpuc_k40.h5ad``
    The gpuc run (no X): ``obs["metacell"]``, ``obs["bulk_labels"]``, ``obsm["metacell_weights"]`` (the soft
    assignments fed to SEACells, cells x metacells), ``obsm["metacell_archetypes"]``, ``uns["metacell"]``.
``seacells033_soft_reference.npz``
    What SEACells 0.3.3 returns on those weights (``A = weights.T``, SEACells' metacells x cells layout):

    * ``sparsify_<w>_{data,indices,indptr}`` - ``core.sparsify_assignments(A.T, thresh=w)`` as CSR (w = 0.05, 0.2);
    * ``soft_<w>_X``, ``soft_<w>_sizes``, ``soft_<w>_celltype``, ``soft_<w>_purity`` - ``core.summarize_by_soft_SEACell(
      ad, A, celltype_label="bulk_labels", summarize_layer="counts", minimum_weight=w)``: X, ``obs["Pseudo-sizes"]``,
      ``obs["celltype"]``, ``obs["celltype_purity"]``;
    * ``entropy`` - ``scipy.stats.entropy(A, axis=0)``, the ``obs["Metacell_Entropy"]`` the pre-release SEACells
      model wrote and ``SEACells.plot.plot_assignment_entropy`` plots;
    * ``n_nontrivial`` - ``(A.T > 0.1).sum(axis=1)`` and ``top5`` - ``np.sort(np.partition(A.T, -5)[:, -5:])[:, ::-1]``
      (the SEACells tutorial's assignment QC; the first column is the maximum weight);
    * ``dc`` - Palantir's ``determine_multiscale_space(run_diffusion_maps(X_pca), n_eigs=10)``, the space of
      ``evaluate.separation``;
    * ``sep_<case>_labels``, ``sep_<case>_values`` - ``evaluate.separation(ad, "X_pca", nth_nbr=n, cluster=c)`` with
      ``obs["SEACell"]`` = the gpuc hard labels, for ``all1`` (n=1, no cluster), ``bulk1`` (n=1,
      cluster="bulk_labels") and ``bulk2`` (n=2, cluster="bulk_labels"): the metacells returned and their values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp
import scipy.stats
import tqdm
from anndata import AnnData

import gpuc

HERE = Path(__file__).parent
WEIGHTS = (0.05, 0.2)


def main() -> None:
    import palantir
    import SEACells.build_graph
    import SEACells.core
    import SEACells.evaluate

    SEACells.core.tqdm = tqdm.tqdm  # the notebook progress bar needs a Jupyter front end (SEACells issue #71)

    ad = sc.datasets.pbmc68k_reduced()
    gpuc.tl.metacells(ad, n_metacells=40, device="cpu", random_state=0)
    run = AnnData(obs=ad.obs[["metacell", "bulk_labels"]].copy())
    run.obsm["metacell_weights"] = ad.obsm["metacell_weights"]
    run.obsm["metacell_archetypes"] = ad.obsm["metacell_archetypes"]
    run.uns["metacell"] = ad.uns["metacell"]
    run.write_h5ad(HERE / "pbmc68k_gpuc_k40.h5ad", compression="gzip")

    z = np.load(HERE.parent / "nmf" / "pbmc68k_counts_700x500.npz", allow_pickle=False)
    counts = sp.csr_matrix((z["data"], z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    assert list(z["obs"]) == list(ad.obs_names)
    cad = AnnData(X=counts.astype(np.float32), obs=ad.obs[["bulk_labels"]].copy(), var=pd.DataFrame(index=z["var"]))
    cad.layers["counts"] = counts

    A = np.asarray(ad.obsm["metacell_weights"].toarray().T)  # SEACells' k x n layout
    out: dict[str, np.ndarray] = {}
    for w in WEIGHTS:
        s = sp.csr_matrix(SEACells.core.sparsify_assignments(A.T, thresh=w))
        out[f"sparsify_{w}_data"], out[f"sparsify_{w}_indices"], out[f"sparsify_{w}_indptr"] = (
            s.data,
            s.indices,
            s.indptr,
        )
        soft = SEACells.core.summarize_by_soft_SEACell(
            cad, A, celltype_label="bulk_labels", summarize_layer="counts", minimum_weight=w
        )
        out[f"soft_{w}_X"] = np.asarray(soft.X.toarray())
        out[f"soft_{w}_sizes"] = soft.obs["Pseudo-sizes"].to_numpy()
        out[f"soft_{w}_celltype"] = soft.obs["celltype"].to_numpy(dtype=str)
        out[f"soft_{w}_purity"] = soft.obs["celltype_purity"].to_numpy()

    out["entropy"] = scipy.stats.entropy(A, axis=0)
    out["n_nontrivial"] = (A.T > 0.1).sum(axis=1)
    out["top5"] = np.sort(np.partition(A.T, -5)[:, -5:])[:, ::-1]

    comps = pd.DataFrame(ad.obsm["X_pca"]).set_index(ad.obs_names)
    out["dc"] = palantir.utils.determine_multiscale_space(
        palantir.utils.run_diffusion_maps(comps), n_eigs=10
    ).to_numpy()
    ad.obs["SEACell"] = ad.obs["metacell"].astype(str)  # plain strings: the groupbys see only present labels
    for case, nth, cluster in (("all1", 1, None), ("bulk1", 1, "bulk_labels"), ("bulk2", 2, "bulk_labels")):
        sep = SEACells.evaluate.separation(ad, "X_pca", nth_nbr=nth, cluster=cluster)
        col = sep.iloc[:, 0]
        out[f"sep_{case}_labels"] = col.index.to_numpy(dtype=str)
        out[f"sep_{case}_values"] = col.to_numpy(dtype=float)

    assert all(v.dtype != object for v in out.values())  # loads with allow_pickle=False
    np.savez_compressed(HERE / "seacells033_soft_reference.npz", **out)
    for k, v in out.items():
        print(k, v.shape, v.dtype)


if __name__ == "__main__":
    main()
