"""``gpuc.tl.rlog`` and ``gpuc.tl.normalized_counts``: DESeq2's regularised log and normalised counts."""

from __future__ import annotations

import warnings
from typing import Any, Literal

import numpy as np
from anndata import AnnData

from gpuc import _keys
from gpuc._backend import Device, get_backend
from gpuc._dask import resolve_client, runs_on
from gpuc._docs import doc_params
from gpuc._errors import GpucWarning, interruptible
from gpuc._validate import (
    check_adata,
    check_bool,
    check_int,
    check_key,
    check_key_added,
    check_number,
)
from gpuc.tl._deseq import _check_fit_options, _fitted, _transform_counts


# --------------------------------------------------------------------------------------------------------------------
# rlog
# --------------------------------------------------------------------------------------------------------------------
@doc_params()
def rlog(
    adata: AnnData,
    *,
    layer: str | None = None,
    blind: bool = True,
    fit_type: Literal["parametric", "local", "mean"] = "parametric",
    beta_prior_var: float | None = None,
    key: str = _keys.DESEQ,
    block_genes: int | None = None,
    device: Device | None = None,
    n_jobs: int | None = None,
    client: Any = None,
    key_added: str = _keys.RLOG,
    copy: bool = False,
) -> AnnData | None:
    """Regularised log transformation of counts (R DESeq2 ``rlog``).

    Each gene gets a negative-binomial GLM with an intercept and one coefficient per sample under a normal prior
    (variance fitted from the data, R's ``betaPriorVar``) and the trend dispersion; the transformed values are the
    fitted log2 normalised counts. Low counts are shrunk towards the gene's mean, which stabilises their variance.
    R recommends it over :func:`vst` below ~30 samples when size factors vary widely. The per-gene fits are
    independent, so they run at once on the CPU or a GPU, or in gene blocks (``block_genes``, ``client``).

    Parameters
    ----------
    adata
        Samples x genes AnnData with raw counts. A dask array (a lazily read AnnData) is loaded into memory.
    layer
        Layer with the counts; ``None`` uses ``X``.
    blind
        Fit size factors and the dispersion trend with an intercept-only design (R's default, for quality
        assessment). ``blind=False`` reuses the size factors, ``baseMean`` and trend dispersions (``dispFit``) of
        an earlier :func:`deseq` run stored under ``key``, as R's ``rlog(dds, blind=FALSE)`` after ``DESeq``.
    fit_type
        Trend type for a blind fit.
    beta_prior_var
        Prior variance of the sample coefficients (log2 scale); ``None`` estimates it as R does. Pass the
        ``uns[key_added]["beta_prior_var"]`` of an earlier run (with ``blind=False``) to freeze it.
    key
        ``key_added`` of the :func:`deseq` run used when ``blind=False``.
    block_genes
        Fit the genes in blocks of this many, one after the other or as Dask tasks on ``client`` (the values do not
        change); ``None``: all genes in one block (one task).
    {device}
    {n_jobs}
    client
        ``None`` follows :attr:`gpuc.settings.client` (default: in this process); a ``distributed.Client`` or
        ``"default"`` runs the gene blocks as Dask tasks.
    key_added
        Name of the layer written (and prefix of the ``var`` column).
    {copy}

    Returns
    -------
    ``None`` or the modified copy. Writes

    - ``adata.layers[key_added]``: the rlog values (samples x genes, log2 scale; R's ``assay(rlog(dds))``, 0 for
      genes with no count);
    - ``adata.var[f"{key_added}_intercept"]``: the fitted log2 intercept (R's ``mcols(rld)$rlogIntercept``; -inf
      for genes with no count);
    - ``adata.uns[key_added]``: ``params``, ``device``, ``beta_prior_var`` (R's ``attr(rld, "betaPriorVar")``),
      ``trend`` (the dispersion trend fitted, or with ``blind=False`` that of the :func:`deseq` run) and
      ``n_not_converged`` (genes whose fit stopped at 100 iterations or diverged, as R's ``betaConv`` is FALSE; R
      keeps their last values, and so does gpuc).

    Replaces all of them if they exist.

    Warns
    -----
    GpucWarning
        When the trend fit fell back to another type, as R does, or some genes did not converge.
    """
    _check_fit_options(adata, key_added, fit_type, blind, copy)
    if beta_prior_var is not None:
        beta_prior_var = check_number("beta_prior_var", beta_prior_var, low=0, low_open=True)
    if block_genes is not None:
        check_int("block_genes", block_genes, minimum=1)
    counts = _transform_counts(
        adata, layer, key_added, "rlog", _keys.RLOG, _keys.rlog_outputs(key_added), _keys.RLOG_MARKER
    )
    fitted: dict[str, Any] = {}
    if not blind:
        _fitted(adata, key)
        for field in ("baseMean", "dispFit"):
            check_key(adata.var, _keys.deseq_var(key, field), "adata.var", "Rerun gpuc.tl.deseq.")
        fitted = {
            "size_factors": adata.obs[_keys.deseq_size_factors(key)].to_numpy(dtype=np.float64),
            "base_mean": adata.var[_keys.deseq_var(key, "baseMean")].to_numpy(dtype=np.float64),
            "disp_fit": adata.var[_keys.deseq_var(key, "dispFit")].to_numpy(dtype=np.float64),
        }
    backend = get_backend(device, counts, tool="deseq", work=float(counts.shape[0]) * float(counts.shape[1]))
    dask_client = resolve_client(client)

    # ---- one engine call
    from gpuc.deseq._rlog import regularized_log

    with interruptible("rlog"):
        res = regularized_log(
            backend,
            counts,
            fit_type=fit_type,
            beta_prior_var=beta_prior_var,
            client=dask_client,
            block_genes=block_genes,
            n_jobs=n_jobs,
            **fitted,
        )
    if res.note:
        warnings.warn(res.note, GpucWarning, stacklevel=2)
    n_bad = int((~res.converged).sum())
    if n_bad:
        warnings.warn(
            f"rlog: {n_bad} gene(s) did not converge in 100 iterations or diverged; their values are the last "
            "iterate, as in R (uns[key_added]['n_not_converged']).",
            GpucWarning,
            stacklevel=2,
        )

    # ---- write
    adata = adata.copy() if copy else adata
    _keys.drop_outputs(adata, _keys.rlog_outputs(key_added))
    adata.layers[key_added] = res.values
    adata.var[_keys.rlog_intercept(key_added)] = res.intercept
    params = {
        "layer": layer,
        "blind": bool(blind),
        "fit_type": fit_type,
        "beta_prior_var": beta_prior_var,
        "key": key,
        "block_genes": block_genes,
        "device": device,
        "n_jobs": n_jobs,
    }
    adata.uns[key_added] = {
        "params": params,
        "device": runs_on(backend, dask_client),
        "beta_prior_var": res.beta_prior_var,
        # blind=False: the trend of the deseq run, whose values at each gene (var[f"{key}_dispFit"]) were used
        "trend": res.trend.to_dict() if res.trend is not None else dict(adata.uns[key].get("trend", {})),
        "n_not_converged": n_bad,
    }
    return adata if copy else None


# --------------------------------------------------------------------------------------------------------------------
# normalised counts
# --------------------------------------------------------------------------------------------------------------------
def normalized_counts(
    adata: AnnData,
    *,
    layer: str | None = None,
    fpm: bool = False,
    robust: bool = True,
    key: str | None = _keys.DESEQ,
    key_added: str | None = None,
    copy: bool = False,
) -> AnnData | None:
    """Counts divided by size factors (R's ``counts(dds, normalized=TRUE)``), or fragments per million (``fpm``).

    Parameters
    ----------
    adata
        Samples x genes AnnData with raw counts.
    layer
        Layer with the counts; ``None`` uses ``X``.
    fpm
        Write R's ``fpm(dds, robust=robust)`` instead: counts per million of a library size. With ``robust`` the
        library size is the size factor times the geometric mean of the samples' total counts (so the values are
        the normalised counts rescaled to a million); otherwise the sample's total count.
    robust
        See ``fpm``.
    key
        ``key_added`` of a :func:`deseq` run whose size factors (``obs[f"{key}_size_factors"]``) are used; when
        that run is absent, or ``key=None``, median-of-ratios size factors are computed here (R's
        ``estimateSizeFactors``; poscounts with a warning when every gene has a zero, as :func:`deseq` does).
    key_added
        Name of the layer written; ``None``: ``"fpm"`` when ``fpm`` else ``"normalized"``.
    copy
        Return a modified copy instead of writing into ``adata``; the copy shares no mutable object with ``adata``.

    Returns
    -------
    ``None`` or the modified copy. Writes ``adata.layers[key_added]`` (samples x genes float64; dense) and
    ``adata.uns[key_added]`` (``params``, ``size_factors``: the size factors used, ``source``: ``"deseq"`` or
    ``"computed"``); replaces both if they exist.
    """
    check_adata(adata)
    check_bool("fpm", fpm)
    check_bool("robust", robust)
    check_bool("copy", copy)
    key_added = key_added if key_added is not None else (_keys.FPM if fpm else _keys.NORMALIZED)
    check_key_added(key_added)
    counts = _transform_counts(
        adata,
        layer,
        key_added,
        "normalized_counts",
        key_added,
        _keys.normalized_outputs(key_added),
        _keys.NORMALIZED_MARKER,
    )
    from gpuc.deseq._blocks import _gene_major

    y = _gene_major(counts)  # genes x samples, host float64
    sf_col = None if key is None else _keys.deseq_size_factors(key)
    note = None
    if sf_col is not None and sf_col in adata.obs.columns:
        sf = adata.obs[sf_col].to_numpy(dtype=np.float64)
        source = "deseq"
    elif fpm and not robust:
        sf, source = np.ones(adata.n_obs), "not used"
    else:
        from gpuc.deseq._pipeline import compute_size_factors

        bk = get_backend("cpu")
        sf, _, note = compute_size_factors(bk, y, "ratio")
        sf, source = np.asarray(sf, dtype=np.float64), "computed"
    if note:
        warnings.warn(note, GpucWarning, stacklevel=2)
    totals = y.sum(axis=0)
    if not fpm:
        scale = sf
    elif robust:
        with np.errstate(divide="ignore"):
            scale = sf * np.exp(np.mean(np.log(totals))) / 1e6
    else:
        scale = totals / 1e6
    with np.errstate(divide="ignore", invalid="ignore"):
        values = (y / scale[None, :]).T.copy()

    adata = adata.copy() if copy else adata
    _keys.drop_outputs(adata, _keys.normalized_outputs(key_added))
    adata.layers[key_added] = values
    adata.uns[key_added] = {
        "params": {"layer": layer, "fpm": bool(fpm), "robust": bool(robust), "key": key},
        "size_factors": np.asarray(sf, dtype=np.float64),
        "source": source,
    }
    return adata if copy else None
