"""starCAT (starcatpy 1.0.10) usages of two queries on cNMF 1.7.1's k=7 programmes: the parity reference of
``tests/nmf/test_nmf_project.py``.

Reference: cNMF's k=7 consensus median spectra (``../cnmf_k7_dt0_5_median_spectra.npz``, 7 programmes x 500 genes,
fitted by cNMF on the 700 pbmc68k cells of ``../pbmc68k_counts_700x500.npz``), written in starCAT's reference format
(``reference.tsv``: programmes x genes, tab-separated). Queries:

* ``same``: the 700 cells' counts (the data the programmes were learned on);
* ``thinned``: the same cells binomially thinned to half their counts (another sequencing depth), without 20 of the
  reference's genes (4 %, as when a query lacks some genes); its counts are stored here as CSR parts ``thinned_*``.

For each, ``starCAT(reference=reference.tsv).fit_transform(query, return_unnormalized=True)`` (starCAT's default path:
the query's genes scaled by their own SD without centring, then scikit-learn's ``non_negative_factorization`` with
``solver='mu'``, ``tol=1e-4``, ``max_iter=1000``, ``update_H=False``), and its normalised usages.

Run (own venv with starcatpy; nothing here is needed by the tests):

    python -m venv /tmp/venv-starcat && /tmp/venv-starcat/bin/pip install starcatpy==1.0.10
    /tmp/venv-starcat/bin/python tests/data/nmf/starcat/make_reference.py
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pandas as pd
import scipy.sparse as sp
from anndata import AnnData

HERE = Path(__file__).resolve().parent
N_DROP = 20  # reference genes removed from the thinned query


def main() -> None:
    import sklearn
    import starcat
    from starcat import starCAT

    z = np.load(HERE.parent / "pbmc68k_counts_700x500.npz", allow_pickle=False)
    counts = sp.csr_matrix((z["data"].astype(np.float64), z["indices"], z["indptr"]), shape=tuple(z["shape"]))
    cells, genes = z["obs"].astype(str), z["var"].astype(str)
    ref = np.load(HERE.parent / "cnmf_k7_dt0_5_median_spectra.npz", allow_pickle=False)
    assert (ref["genes"].astype(str) == genes).all()
    names = [f"GEP{i + 1}" for i in range(ref["median_spectra"].shape[0])]
    table = pd.DataFrame(ref["median_spectra"], index=names, columns=genes)
    table.to_csv(HERE / "reference.tsv", sep="\t", float_format="%.9g")

    rng = np.random.default_rng(20261207)
    thin = counts.copy()
    thin.data = rng.binomial(thin.data.astype(np.int64), 0.5).astype(np.float64)
    keep = np.sort(rng.choice(len(genes), len(genes) - N_DROP, replace=False))
    thin = thin[:, keep]
    thin.eliminate_zeros()
    queries = {
        "same": AnnData(counts, obs=pd.DataFrame(index=cells), var=pd.DataFrame(index=genes)),
        "thinned": AnnData(thin, obs=pd.DataFrame(index=cells), var=pd.DataFrame(index=genes[keep])),
    }
    out: dict[str, np.ndarray] = {
        "programs": np.asarray(names),
        "thinned_data": thin.data.astype(np.int32),
        "thinned_indices": thin.indices.astype(np.int32),
        "thinned_indptr": thin.indptr.astype(np.int64),
        "thinned_shape": np.asarray(thin.shape),
        "thinned_genes": genes[keep],
        "versions": np.asarray(
            [f"starcatpy {getattr(starcat, '__version__', '1.0.10')}", f"sklearn {sklearn.__version__}"]
        ),
    }
    for name, query in queries.items():
        cat = starCAT(reference=str(HERE / "reference.tsv"))
        with contextlib.redirect_stdout(io.StringIO()):
            usage, _ = cat.fit_transform(query, return_unnormalized=True)
        assert list(usage.columns) == names and list(usage.index) == list(cells)
        out[f"{name}_usage"] = usage.to_numpy(dtype=np.float64)
        out[f"{name}_usage_norm"] = cat.usage_norm.to_numpy(dtype=np.float64)
        out[f"{name}_overlap_genes"] = np.asarray(cat.overlap_genes).astype(str)
    np.savez_compressed(HERE / "starcat_usages.npz", **out)
    print({k: v.shape for k, v in out.items()})


if __name__ == "__main__":
    main()
