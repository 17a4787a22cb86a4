"""``gpuc.get.nmf_top_genes`` / ``nmf_gene_scores`` / ``nmf_gene_spectra`` (the genes of each consensus NMF programme),
``nmf_usages`` and ``nmf_suggest_k``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc._backend import to_host
from gpuc._docs import doc_params
from gpuc._errors import GpucWarning
from gpuc._validate import check_adata, check_bool, check_int, check_key, get_matrix, str_array
from gpuc.get._checks import tool_output
from gpuc.nmf._all_genes import TARGET_SUM, row_totals, score_spectra
from gpuc.nmf._consensus import SUGGEST_MIN_GAIN, SUGGEST_TOL, suggest_k

# the ``adata`` of the getters that read a consensus fit, refined or not
_REFINED_RUN = "adata\n    AnnData after :func:`gpuc.tl.consensus_nmf` (or :func:`gpuc.tl.nmf_refine`)."


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


def _stored(adata: AnnData, slot: str, name: str, key: str, what: str) -> np.ndarray:
    """``adata.<slot>[name]`` (cNMF's all-gene outputs of :func:`gpuc.tl.consensus_nmf`) as a host float64 array."""
    container = getattr(adata, slot)
    if name not in container:
        msg = (
            f"{what} not found (adata.{slot}[{name!r}]): rerun gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) "
            "with all_genes=True (the default), or gpuc.tl.nmf_refine(adata, density_threshold, "
            f"key={key!r}) on this result, to compute cNMF's outputs over every gene."
        )
        raise KeyError(msg)
    return np.asarray(to_host(container[name]), dtype=np.float64)


def _all_gene_matrix(adata: AnnData, params: Mapping[str, Any], normalize: bool | None) -> tuple[Any, bool, str]:
    """The matrix cNMF's all-gene outputs of a consensus are computed from (as :func:`gpuc.tl.consensus_nmf`
    chose it: ``counts_layer``, else the factorised ``layer``), whether to scale its cells to 10⁶, and its name.
    """
    counts_layer = params.get("counts_layer")
    layer = counts_layer if counts_layer is not None else params.get("layer")
    layer = None if layer is None else str(layer)
    if normalize is None:
        normalize = counts_layer is not None or params.get("preprocessing", "none") != "none"
    if not isinstance(normalize, bool | np.bool_):
        msg = f"normalize must be True, False or None, got {normalize!r}."
        raise TypeError(msg)
    where = f"adata.layers[{layer!r}]" if layer is not None else "adata.X"
    return get_matrix(adata, layer=layer), bool(normalize), where


def nmf_gene_scores(adata: AnnData, *, key: str = _keys.NMF, normalize: bool | None = None) -> pd.DataFrame:
    """The gene spectra scores of cNMF over every gene: how much each gene's expression rises with each programme's
    usage.

    For every gene, its expression is z-scored over the cells (mean 0, variance 1, population variance), and its
    scores are the least-squares coefficients, without intercept, of that z-scored expression on the programmes'
    usages (``obsm['X_' + key]``): ``scores = (UᵀU)⁻¹ Uᵀ Z``. This is cNMF 1.7's ``gene_spectra_score``
    (``efficient_ols_all_cols`` of the z-scored TPM on the consensus usages), the ranking its authors recommend for
    reading a programme's marker genes and for enrichment: unlike the spectra weights (:func:`nmf_top_genes` with
    ``by="weight"``), which favour genes highly expressed everywhere (ribosomal genes, MALAT1, FTL), a score is
    high only for a gene whose expression follows the programme's usage across cells, in units of that gene's own
    variation. Every gene is scored, not only the factorised (highly variable) ones: a marker or a transcription
    factor left out of the fit still shows up in its programme.

    By default this is ``varm[key + '_spectra_score']``, written by :func:`gpuc.tl.consensus_nmf` (see its
    ``counts_layer``). Without it (``all_genes=False``, or an AnnData written by an older gpuc), or with
    ``normalize`` given, the scores are computed here from the same matrix: ``layers[params['counts_layer']]``,
    else the matrix that was factorised (``layers[params['layer']]`` or ``X``), over every gene, on the device
    where it lives (chunk by chunk for a lazily read one). With ``normalize``, each cell is first scaled to 10⁶
    counts over all its genes (cNMF's TPM; the scores do not depend on the target sum): the default when
    ``counts_layer`` was given or ``preprocessing`` was ``'sd'`` or ``'sqrt_sd'`` (raw counts, cNMF's input:
    ``gpuc.tl.consensus_nmf(adata, k, layer="counts", mask_var="highly_variable", preprocessing="sd")``). For
    ``preprocessing='none'`` (bixverse's input, a log-normalised layer) the layer is used as it is.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`.
    key
        The ``key_added`` of the consensus call.
    normalize
        ``None``: the stored scores, or the rule above. ``True``/``False``: recompute, with or without scaling each
        cell to the same total count before z-scoring.

    Returns
    -------
    A :class:`~pandas.DataFrame`, genes (all of ``var_names``) x programmes (columns ``P1`` ... ``Pk``), of scores.
    """
    sk = _keys.nmf_spectra_score(key)
    stored = normalize is None and sk in adata.varm
    u = _nmf_fit(adata, key, need_uns=not stored)
    uk = _keys.nmf_usages(key)
    check_key(adata.obsm, uk, "adata.obsm", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
    k = int(np.shape(adata.obsm[uk])[1])
    if stored:
        scores = _stored(adata, "varm", sk, key, "cNMF's gene spectra scores")
        return pd.DataFrame(scores, index=adata.var_names, columns=program_names(k))
    mat, normalize, _ = _all_gene_matrix(adata, u["params"], normalize)
    scale = TARGET_SUM / row_totals(mat) if normalize else None
    usages = np.asarray(to_host(adata.obsm[uk]), dtype=np.float64)
    scores = score_spectra(mat, usages, scale)
    return pd.DataFrame(scores.T, index=adata.var_names, columns=program_names(k))


def gene_scores(expr: Any, usages: np.ndarray, totals: np.ndarray | None = None) -> np.ndarray:
    """``(k, genes)`` least-squares coefficients of each z-scored column of ``expr`` on ``usages`` (no intercept).

    ``expr`` is cells x genes (numpy, scipy.sparse, their CuPy twins, or a dask array of those; never densified
    whole); with ``totals`` (one per cell) each row is first divided by its total. Genes of zero variance get the
    floor SD of cNMF (1e-6, i.e. variance 1e-12). :func:`gpuc.nmf._all_genes.score_spectra` does the work.
    """
    scale = None if totals is None else 1.0 / np.maximum(np.asarray(totals, dtype=np.float64).ravel(), 1e-300)
    return score_spectra(expr, usages, scale)


@doc_params(refined_run=_REFINED_RUN)
def nmf_gene_spectra(
    adata: AnnData, kind: Literal["score", "tpm", "consensus"] = "score", *, key: str = _keys.NMF
) -> pd.DataFrame:
    """The gene spectra (cNMF's) of every programme written by :func:`gpuc.tl.consensus_nmf`, genes x programmes.

    Parameters
    ----------
    {refined_run}
    kind
        ``"score"`` (default): cNMF's ``gene_spectra_score`` over every gene (``varm[key + '_spectra_score']``,
        :func:`nmf_gene_scores`): z-scored expression regressed on the usages, what to read and to rank for
        enrichment. ``"tpm"``: cNMF's ``gene_spectra_tpm`` over every gene (``varm[key + '_spectra_tpm']``): each
        programme's expression profile in TPM units (transcripts per million per unit of normalised usage), the
        non-negative refit of the TPM matrix on the usages normalised per cell. ``"consensus"``: the consensus
        spectra over the factorised genes only (``varm[key + '_spectra']``; cNMF's ``consensus_spectra``, each
        programme summing to 1 with ``normalization="sum"``).
    key
        The ``key_added`` of the consensus call.

    Returns
    -------
    A :class:`~pandas.DataFrame` indexed by gene (every gene of ``var_names``; the factorised ones for
    ``"consensus"``), one column per programme (``P1`` ...).
    """
    # the all-gene spectra belong to one fit's uns entry: without it (dropped, or an anndata.concat) they are refused
    u = _nmf_fit(adata, key, need_uns=kind in ("score", "tpm"))
    if kind == "score":
        return nmf_gene_scores(adata, key=key)
    if kind == "tpm":
        values = _stored(adata, "varm", _keys.nmf_spectra_tpm(key), key, "cNMF's TPM gene spectra")
        return pd.DataFrame(values, index=adata.var_names, columns=program_names(values.shape[1]))
    if kind == "consensus":
        idx = _factorised(adata, key, u)
        values = np.asarray(to_host(adata.varm[_keys.nmf_spectra(key)]), dtype=np.float64)[idx]
        return pd.DataFrame(values, index=adata.var_names[idx], columns=program_names(values.shape[1]))
    msg = f"kind={kind!r} is not valid; choose one of 'score', 'tpm', 'consensus'."
    raise ValueError(msg)


@doc_params(refined_run=_REFINED_RUN)
def nmf_usages(
    adata: AnnData, kind: Literal["refit", "consensus"] = "refit", *, key: str = _keys.NMF, normalize: bool = True
) -> pd.DataFrame:
    """The usages of every programme in every cell written by :func:`gpuc.tl.consensus_nmf`, as a table.

    Parameters
    ----------
    {refined_run}
    kind
        ``"refit"`` (default): cNMF's final usages (``obsm['X_' + key + '_refit']``, its ``consensus_usages``
        file with the default ``refit_usage=True``: the TPM of the factorised genes, scaled by their SD, refitted
        on the TPM spectra). ``"consensus"``: the refit of the factorised matrix on the consensus spectra
        (``obsm['X_' + key]``, which the gene spectra scores are regressed on).
    key
        The ``key_added`` of the consensus call.
    normalize
        Divide each cell's usages by their sum, so they are the fractions of the cell's expression each programme
        explains (cNMF's ``norm_usage``, the default of its ``load_results``); cells with no usage stay zero.
        ``False``: the usages as fitted.

    Returns
    -------
    A :class:`~pandas.DataFrame`, cells (``obs_names``) x programmes (``P1`` ...).
    """
    _nmf_fit(adata, key, need_uns=False)
    check_bool("normalize", normalize)
    if kind == "refit":
        values = _stored(adata, "obsm", _keys.nmf_usages_refit(key), key, "cNMF's final (refitted) usages")
    elif kind == "consensus":
        uk = _keys.nmf_usages(key)
        check_key(adata.obsm, uk, "adata.obsm", f"Run gpuc.tl.consensus_nmf(adata, k, key_added={key!r}) first.")
        values = np.asarray(to_host(adata.obsm[uk]), dtype=np.float64)
    else:
        msg = f"kind={kind!r} is not valid; choose one of 'refit', 'consensus'."
        raise ValueError(msg)
    if normalize:
        rs = values.sum(axis=1, keepdims=True)
        values = values / np.where(rs > 0, rs, 1.0)
    return pd.DataFrame(values, index=adata.obs_names, columns=program_names(values.shape[1]))


def nmf_top_genes(
    adata: AnnData,
    n: int = 20,
    *,
    key: str = _keys.NMF,
    by: Literal["score", "tpm", "weight"] = "score",
    wide: bool = False,
) -> pd.DataFrame:
    """Top ``n`` genes of every programme written by :func:`gpuc.tl.consensus_nmf`.

    By score (the default) and by TPM every gene is ranked, as cNMF's top genes (``load_results``) are: a marker
    left out of the highly variable genes still shows up in its programme. By weight only the factorised genes
    (``uns[key]['genes']``) are ranked: the consensus spectra hold no other gene.

    Parameters
    ----------
    adata
        AnnData after :func:`gpuc.tl.consensus_nmf`.
    n
        Genes per programme (at most the number of genes ranked).
    key
        The ``key_added`` of the consensus call.
    by
        ``"score"`` (default): cNMF's gene spectra score (:func:`nmf_gene_scores`), the genes whose expression
        rises most with the programme's usage, in units of each gene's own variation; these name the cell types
        and activities the programmes stand for (on pbmc3k: LYZ, CD14 for monocytes, MS4A1, CD79A for B cells ...).
        ``"tpm"``: cNMF's TPM spectra (:func:`nmf_gene_spectra` with ``kind="tpm"``), the most expressed genes of
        the programme, dominated by genes expressed highly everywhere. ``"weight"``: the consensus spectra weights
        (``varm[key + '_spectra']``), over the factorised genes.
    wide
        Return one column of gene names per programme (rows = rank) instead of the tidy long table.

    Returns
    -------
    Long format (default): columns ``program`` (``P1`` ...), ``rank`` (1 = highest), ``gene``, and ``score``,
    ``tpm`` or ``weight`` (the spectra entry; a programme's weights sum to 1 over the genes with
    ``normalization="sum"``). Wide format: index ``rank``, one column per programme holding gene names.
    """
    check_adata(adata)
    n = check_int("n", n, minimum=1)
    if by not in ("score", "tpm", "weight"):
        msg = f"by={by!r} is not valid; choose one of 'score', 'tpm', 'weight'."
        raise ValueError(msg)
    table = nmf_gene_spectra(adata, {"score": "score", "tpm": "tpm", "weight": "consensus"}[by], key=key)
    values, genes = table.to_numpy(), np.asarray(table.index)
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
