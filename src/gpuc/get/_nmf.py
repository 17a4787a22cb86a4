"""``gpuc.get.nmf_top_genes`` / ``nmf_gene_scores`` (the genes of each consensus NMF programme) and ``nmf_suggest_k``."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc._backend import backend_of, is_sparse, to_host
from gpuc._dask import is_dask_array
from gpuc._errors import GpucWarning
from gpuc._lazy import load
from gpuc._validate import check_adata, check_int, check_key, get_matrix, str_array
from gpuc.get._checks import tool_output
from gpuc.nmf._consensus import SUGGEST_MIN_GAIN, SUGGEST_TOL, suggest_k


def program_names(k: int) -> list[str]:
    """Names of the programmes as used in tables and plots: ``P1 .. Pk`` (ordered by total usage)."""
    return [f"P{i + 1}" for i in range(k)]


def _factorised(adata: AnnData, key: str, u: Any) -> np.ndarray:
    """Indices (into ``var_names``) of the genes :func:`gpuc.tl.consensus_nmf` factorised under ``key``.

    ``uns[key]['genes']`` names them; without it (an AnnData holding only the spectra), the genes with any non-zero
    weight stand in, since genes left out of the fit have zero weight in every programme.
    """
    if isinstance(u, Mapping) and "genes" in u:
        names = str_array(u["genes"])  # zarr gives numpy StringDType, which .astype(str) refuses
        idx = pd.Index(adata.var_names).get_indexer(names)
        if (idx < 0).any():
            missing = list(names[idx < 0][:5])
            msg = (
                f"{int((idx < 0).sum())} gene(s) that consensus_nmf factorised under key={key!r} are no longer in "
                f"adata.var_names (e.g. {missing}): the AnnData was subset after the fit."
            )
            raise KeyError(msg)
        return idx
    spectra = np.asarray(adata.varm[_keys.nmf_spectra(key)])
    return np.flatnonzero((spectra != 0).any(axis=1))


def _nmf_fit(adata: AnnData, key: str, *, need_uns: bool) -> Any:
    """``uns[key]`` of a consensus NMF, after checking that ``key`` names one.

    ``None`` when only its ``varm``/``obsm`` arrays were copied in and ``need_uns`` is False.
    """
    check_adata(adata)
    sk = _keys.nmf_spectra(key)
    if key in adata.uns or need_uns:
        u = tool_output(adata, key, "consensus_nmf")
    else:
        u = None
    check_key(adata.varm, sk, "adata.varm", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    return u


def nmf_gene_scores(adata: AnnData, *, key: str = _keys.NMF, normalize: bool | None = None) -> pd.DataFrame:
    """The gene spectra scores of cNMF: how much each factorised gene's expression rises with each programme's usage.

    For every gene, its expression is z-scored over the cells (mean 0, variance 1, population variance), and its
    scores are the least-squares coefficients, without intercept, of that z-scored expression on the programmes'
    usages (``obsm['X_' + key]``): ``scores = (UᵀU)⁻¹ Uᵀ Z``. This is cNMF 1.7's ``gene_spectra_score``
    (``efficient_ols_all_cols`` of the z-scored TPM on the refitted usages), the ranking its authors recommend for
    reading a programme's marker genes: unlike the spectra weights (:func:`nmf_top_genes` with ``by="weight"``),
    which favour genes highly expressed everywhere (ribosomal genes, MALAT1, FTL), a score is high only for a gene
    whose expression follows the programme's usage across cells, in units of that gene's own variation.

    The expression is the matrix the programmes were fitted on, ``layers[params['layer']]`` (or ``X``) as recorded
    in ``uns[key]['params']``, over the genes that were factorised (``uns[key]['genes']``). With ``normalize``,
    each cell is first scaled to 10⁶ counts over all its genes (cNMF's TPM; the scores do not depend on the target
    sum): the default for ``preprocessing='sd'`` or ``'sqrt_sd'``, which factorise raw counts (cNMF's recommended
    input: raw counts of the highly variable genes, each gene divided by its standard deviation without centring,
    which ``gpuc.tl.consensus_nmf(adata, k, layer="counts", mask_var="highly_variable", preprocessing="sd")``
    does). For ``preprocessing='none'`` (bixverse's input, a log-normalised layer) the layer is used as it is.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`, with the matrix it factorised unchanged.
    key
        The ``key_added`` of the consensus call.
    normalize
        Scale each cell to the same total count before z-scoring; ``None`` decides from ``params['preprocessing']``
        as described above.

    Returns
    -------
    A :class:`~pandas.DataFrame`, factorised genes x programmes (columns ``P1`` ... ``Pk``), of scores.
    """
    u = _nmf_fit(adata, key, need_uns=True)
    params = u["params"]
    if normalize is None:
        normalize = params.get("preprocessing", "none") != "none"
    if not isinstance(normalize, bool | np.bool_):
        msg = f"normalize must be True, False or None, got {normalize!r}."
        raise TypeError(msg)
    uk = _keys.nmf_usages(key)
    check_key(adata.obsm, uk, "adata.obsm", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    genes = _factorised(adata, key, u)
    layer = params.get("layer")
    mat = get_matrix(adata, layer=None if layer is None else str(layer))
    where = f"adata.layers[{layer!r}]" if layer is not None else "adata.X"
    totals = _row_totals(mat) if normalize else None
    block = load(mat[:, genes], where)
    usages = np.asarray(adata.obsm[uk], dtype=np.float64)
    scores = gene_scores(block, usages, totals)
    return pd.DataFrame(scores.T, index=adata.var_names[genes], columns=program_names(usages.shape[1]))


def _block_row_totals(block: Any) -> np.ndarray:
    return np.asarray(to_host(block.sum(axis=1)), dtype=np.float64).reshape(-1, 1)


def _row_totals(mat: Any) -> np.ndarray:
    """Each cell's total over all genes, on the host; a lazily read (dask) matrix is summed chunk by chunk."""
    if is_dask_array(mat):
        per_chunk = mat.map_blocks(
            _block_row_totals, chunks=(mat.chunks[0], (1,) * len(mat.chunks[1])), dtype=np.float64
        )
        return np.asarray(per_chunk.sum(axis=1).compute()).ravel()
    return _block_row_totals(mat).ravel()


def gene_scores(expr: Any, usages: np.ndarray, totals: np.ndarray | None = None) -> np.ndarray:
    """``(k, genes)`` least-squares coefficients of each z-scored column of ``expr`` on ``usages`` (no intercept).

    ``expr`` is cells x genes (numpy, scipy.sparse, or their CuPy twins; never densified); with ``totals`` (one per
    cell) each row is first divided by its total. The z-scoring is folded into the normal equations,
    ``Uᵀ Z = (Uᵀ X - (Uᵀ 1) meanᵀ) / sd``, so only ``Uᵀ X`` (one product with the data) is needed. Genes of zero
    variance get the floor SD of cNMF (1e-6, i.e. variance 1e-12).
    """
    bk = backend_of(expr)
    xp = bk.xp
    sparse = is_sparse(expr)
    x = expr.tocsr().astype(np.float64) if sparse else xp.asarray(expr, dtype=np.float64)
    n = x.shape[0]
    if totals is not None:
        scale = xp.asarray(1.0 / np.maximum(np.asarray(totals, dtype=np.float64), 1e-300))
        x = (bk.sparse.diags(scale) @ x).tocsr() if sparse else x * scale[:, None]
    mean = xp.asarray(x.sum(axis=0)).ravel() / n
    sq = xp.asarray((x.multiply(x) if sparse else x * x).sum(axis=0)).ravel() / n
    sd = xp.sqrt(xp.maximum(sq - mean * mean, 1e-12))
    u = xp.asarray(usages)
    utx = xp.asarray((x.T @ u).T) if sparse else u.T @ x  # k x genes
    utz = (utx - u.sum(axis=0)[:, None] * mean[None, :]) / sd[None, :]
    gram = to_host(u.T @ u)
    return np.linalg.lstsq(gram, np.asarray(to_host(utz)), rcond=None)[0]


def nmf_top_genes(
    adata: AnnData,
    n: int = 20,
    *,
    key: str = _keys.NMF,
    by: Literal["score", "weight"] = "score",
    wide: bool = False,
) -> pd.DataFrame:
    """Top ``n`` genes of every programme written by :func:`gpuc.tl.consensus_nmf`.

    Only genes that were factorised (the ``mask_var`` genes, listed in ``uns[key]['genes']``) are ranked: a gene
    left out of the fit has no place in a programme.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`.
    n
        Genes per programme (at most the number of factorised genes).
    key
        The ``key_added`` of the consensus call.
    by
        ``"score"`` (default): cNMF's gene spectra score (:func:`nmf_gene_scores`), the genes whose expression
        rises most with the programme's usage, in units of each gene's own variation; these name the cell types
        and activities the programmes stand for (on pbmc3k: LYZ, CD14 for monocytes, MS4A1, CD79A for B cells ...).
        Needs the matrix the programmes were fitted on (``uns[key]['params']['layer']``). ``"weight"``: the
        consensus spectra weights (``varm[key + '_spectra']``), dominated by genes expressed highly everywhere.
    wide
        Return one column of gene names per programme (rows = rank) instead of the tidy long table.

    Returns
    -------
    Long format (default): columns ``program`` (``P1`` ...), ``rank`` (1 = highest), ``gene``, and ``score`` or
    ``weight`` (the spectra entry; a programme's weights sum to 1 over the genes with ``normalization="sum"``).
    Wide format: index ``rank``, one column per programme holding gene names.
    """
    check_adata(adata)
    n = check_int("n", n, minimum=1)
    if by not in ("score", "weight"):
        msg = f"by={by!r} is not valid; choose one of 'score', 'weight'."
        raise ValueError(msg)
    if by == "score":
        table = nmf_gene_scores(adata, key=key)
        values, genes = table.to_numpy(), np.asarray(table.index)
    else:
        u = _nmf_fit(adata, key, need_uns=False)
        idx = _factorised(adata, key, u)
        values = np.asarray(adata.varm[_keys.nmf_spectra(key)], dtype=np.float64)[idx]  # genes x k
        genes = np.asarray(adata.var_names)[idx]
    n = min(n, values.shape[0])
    names = program_names(values.shape[1])
    order = np.argsort(-values, axis=0, kind="stable")[:n]  # (n, k)
    if wide:
        return pd.DataFrame(
            {p: genes[order[:, j]] for j, p in enumerate(names)}, index=pd.RangeIndex(1, n + 1, name="rank")
        )
    rows = {
        "program": np.repeat(names, n),
        "rank": np.tile(np.arange(1, n + 1), len(names)),
        "gene": genes[order.T.ravel()],
        by: np.take_along_axis(values, order, axis=0).T.ravel(),
    }
    out = pd.DataFrame(rows)
    out["program"] = pd.Categorical(out["program"], categories=names, ordered=True)
    return out


def nmf_suggest_k(
    adata: AnnData,
    *,
    key: str = _keys.NMF_K_SWEEP,
    tol: float = SUGGEST_TOL,
    min_gain: float = SUGGEST_MIN_GAIN,
    error: Literal["median_error", "best_error"] = "median_error",
) -> int | None:
    """The number of programmes a :func:`gpuc.tl.nmf_k_sweep` points to: a stable k at which the error still falls.

    cNMF and bixverse leave k to reading the stability / error plot; the judgement their documentation describes is
    to take a k whose stability is high while the error is still falling. This makes that judgement a rule: with the
    ks in increasing order, the *gain* of a k is how much lower its error is than that of the previous k of the sweep
    (the first k always counts). A k still lowers the error when its gain is at least ``min_gain`` times the total
    drop over the sweep (first error minus the smallest). Among those ks, the suggestion is the **largest k whose
    stability is within** ``tol`` **of the best stability among them**. ks whose consensus failed (NaN stability)
    are never suggested.

    Why it works: past the number of programmes the data hold, an extra component fits noise, so the error still
    falls, but by a small and nearly constant amount (the ``min_gain`` criterion removes those ks), and the restarts
    split the noise in different ways, so the stability drops; below it, the restarts agree but merge real
    programmes, so the largest stable k is taken. On simulated counts with 3 to 10 planted programmes (3 seeds each,
    benchmarks page) the defaults find the planted number every time. The sweep must reach past the k you expect:
    a sweep that stops below it returns its largest stable k. Look at :func:`gpuc.pl.nmf_k_sweep`, which marks the
    suggestion, before you use it.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.nmf_k_sweep`.
    key
        The ``key_added`` of the sweep.
    tol
        How far below the best stability (mean silhouette) a k may be and still be suggested.
    min_gain
        Smallest error drop from the previous k, as a fraction of the sweep's total drop, for a k to count as still
        lowering the error.
    error
        The error column used: the median over restarts (default) or the best restart.

    Returns
    -------
    The suggested k, an int; with the default options it equals ``adata.uns[key]['suggested_k']``. ``None`` when the
    consensus failed for every k of the sweep (all stabilities NaN): there is nothing to suggest, and a k returned
    anyway would look like an answer (``uns[key]['suggested_k']`` is then ``None`` too).

    Warns
    -----
    GpucWarning
        When it returns ``None``, saying why and how to rerun the sweep.
    """
    u = tool_output(adata, key, "nmf_k_sweep")
    for name, value in (("tol", tol), ("min_gain", min_gain)):
        if not (isinstance(value, int | float) and float(value) >= 0):
            msg = f"{name}={value!r} must be a number >= 0."
            raise ValueError(msg)
    if error not in ("median_error", "best_error"):
        msg = f"error={error!r} must be 'median_error' or 'best_error'."
        raise ValueError(msg)
    t = u["table"]
    if not np.isfinite(np.asarray(t["stability"], dtype=np.float64)).any():
        msg = (
            f"the consensus failed for every k of the sweep adata.uns[{key!r}] (k={list(map(int, t['k']))}): too few "
            "components passed the density filter, so no k can be suggested. Rerun gpuc.tl.nmf_k_sweep with "
            "density_threshold=2.0 (keeps every component)."
        )
        warnings.warn(msg, GpucWarning, stacklevel=2)
        return None
    return suggest_k(t["k"], t["stability"], t[error], tol=float(tol), min_gain=float(min_gain))
