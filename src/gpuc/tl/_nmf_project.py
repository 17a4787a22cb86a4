"""``gpuc.tl.nmf_project``: usages of the cells of any AnnData on programmes fitted elsewhere (cNMF's
``refit_usage``, starCAT's ``fit_transform``); an AnnData adapter over :mod:`gpuc.nmf._project`.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Literal

import numpy as np
import pandas as pd
from anndata import AnnData

from gpuc import _keys
from gpuc import _log as logg
from gpuc._backend import Device, get_backend
from gpuc._dask import is_dask_array, resolve_client, runs_on
from gpuc._docs import doc_params
from gpuc._errors import GpucWarning
from gpuc._validate import (
    check_adata,
    check_bool,
    check_choice,
    check_int,
    check_key,
    check_key_added,
    check_number,
    get_matrix,
)
from gpuc.nmf._project import (
    PREPROCESSING,
    GeneMoments,
    ProjectOptions,
    gene_factors,
    gene_moments,
    project,
    select_genes,
)

SCALES = ("query", "reference")
MAX_MISSING = 0.2  # default: at most 20 % of the reference's genes may be absent from the query


def _reference_programmes(reference: Any, key: str) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The reference's programmes as a genes x programmes table, and what is known of how they were fitted
    (``preprocessing``, ``layer``; empty for a table).
    """
    if isinstance(reference, AnnData):
        hint = f"Run gpuc.tl.consensus_nmf(reference, k, key_added={key!r}) first, or pass key= naming its result."
        check_key(reference.uns, key, "reference.uns", hint)
        entry = reference.uns[key]
        if not (hasattr(entry, "get") and "params" in entry and "genes" in entry):
            msg = f"reference.uns[{key!r}] is not the output of gpuc.tl.consensus_nmf (no 'params'/'genes'). {hint}"
            raise KeyError(msg)
        check_key(reference.varm, _keys.nmf_spectra(key), "reference.varm", hint)
        genes = pd.Index(np.asarray(entry["genes"]).astype(str))
        rows = reference.var_names.get_indexer(genes)
        if (rows < 0).any():
            msg = f"reference.uns[{key!r}]['genes'] names genes that reference.var_names lacks; the AnnData changed."
            raise ValueError(msg)
        spectra = np.asarray(reference.varm[_keys.nmf_spectra(key)])[rows]
        names = [str(i) for i in range(spectra.shape[1])]
        params = entry["params"]
        info = {"preprocessing": str(params["preprocessing"]), "layer": params.get("layer")}
        return pd.DataFrame(spectra, index=genes, columns=names), info
    if isinstance(reference, pd.DataFrame):
        table = reference
        if table.shape[0] == 0 or table.shape[1] == 0:
            msg = f"the reference table is empty (shape {table.shape})."
            raise ValueError(msg)
        try:
            values = table.to_numpy(dtype=np.float64)
        except (TypeError, ValueError):
            msg = "the reference table must hold numbers only (genes x programmes, gene names as the index)."
            raise TypeError(msg) from None
        if not np.isfinite(values).all() or (values < 0).any():
            msg = "the reference programmes must be finite and non-negative."
            raise ValueError(msg)
        index = pd.Index(table.index.astype(str))
        if index.has_duplicates:
            dup = list(index[index.duplicated()][:5])
            msg = f"the reference table names genes more than once (e.g. {dup}); keep one row per gene."
            raise ValueError(msg)
        return pd.DataFrame(values, index=index, columns=[str(c) for c in table.columns]), {}
    msg = (
        "reference must be an AnnData after gpuc.tl.consensus_nmf or a pandas DataFrame of genes x programmes (a "
        f"starCAT reference file read with pd.read_csv(path, sep='\\t', index_col=0).T), got {type(reference).__name__}."
    )
    raise TypeError(msg)


def _match_genes(adata: AnnData, ref: pd.DataFrame, max_missing: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference genes matched to ``adata.var_names`` by name: the query column of each present gene, the mask of
    present reference genes, and the missing genes' names. Warns with the fraction missing, raises above
    ``max_missing``.
    """
    names = adata.var_names.astype(str)
    if names.has_duplicates:
        dup = names[names.duplicated()]
        clash = dup[dup.isin(ref.index)]
        if len(clash):
            msg = (
                f"adata.var_names names reference genes more than once (e.g. {list(clash[:5])}), so they cannot be "
                "matched by name; run adata.var_names_make_unique() first."
            )
            raise ValueError(msg)
    cols = pd.Index(names).get_indexer(ref.index) if not names.has_duplicates else _first_index(names, ref.index)
    present = cols >= 0
    missing = np.asarray(ref.index[~present]).astype(str)
    frac = float((~present).mean())
    if present.sum() == 0:
        msg = (
            f"none of the reference's {len(ref.index)} genes is in adata.var_names (e.g. reference {list(ref.index[:3])}"
            f", query {list(names[:3])}); match the gene identifiers (symbols vs Ensembl ids)."
        )
        raise ValueError(msg)
    if frac > max_missing:
        msg = (
            f"{len(missing)} of the reference's {len(ref.index)} genes ({frac:.1%}) are not in adata.var_names (e.g. "
            f"{list(missing[:5])}), more than max_missing={max_missing:g}; usages on so few genes would not be the "
            "reference's programmes. Check the gene identifiers, or raise max_missing knowingly."
        )
        raise ValueError(msg)
    if len(missing):
        msg = (
            f"{len(missing)} of the reference's {len(ref.index)} genes ({frac:.1%}) are not in adata.var_names (e.g. "
            f"{list(missing[:5])}); the usages are fitted on the {int(present.sum())} others "
            "(uns[key_added]['missing_genes'] lists them)."
        )
        warnings.warn(msg, GpucWarning, stacklevel=3)
    return cols[present].astype(np.int64), present, missing


def _first_index(names: pd.Index, genes: pd.Index) -> np.ndarray:
    """Position of each of ``genes`` in ``names`` (which has duplicates, none of them among ``genes``), or -1."""
    pos = pd.Series(np.arange(len(names)), index=names)
    pos = pos[~pos.index.duplicated()]
    return pos.reindex(genes).fillna(-1).to_numpy(dtype=np.int64)


def _reference_moments(reference: AnnData, genes: pd.Index, layer: Any, client: Any, block_rows: int) -> GeneMoments:
    """Per-gene moments of the matrix the reference AnnData was factorised on (its recorded layer), over ``genes``."""
    x = get_matrix(reference, layer=layer)
    cols = reference.var_names.get_indexer(genes)
    return gene_moments(x, np.asarray(cols, dtype=np.int64), block_rows=block_rows, client=client)


def _write_projection(adata: AnnData, key_added: str, obsm: dict[str, np.ndarray], uns: dict[str, Any]) -> None:
    """The only writes of :func:`nmf_project`: earlier outputs under ``key_added`` dropped, then ``obsm`` and ``uns``."""
    _keys.drop_outputs(adata, _keys.nmf_project_outputs(key_added))
    for name, value in obsm.items():
        adata.obsm[name] = value
    adata.uns[key_added] = uns


@doc_params()
def nmf_project(
    adata: AnnData,
    reference: AnnData | pd.DataFrame,
    *,
    key: str = _keys.NMF,
    layer: str | None = None,
    preprocessing: Literal["none", "sd", "sqrt_sd"] | None = None,
    scale: Literal["query", "reference"] = "query",
    max_missing: float = MAX_MISSING,
    normalize: bool = False,
    block_size: int = 10_000,
    max_iter: int = 1000,
    tol: float = 1e-6,
    device: Device | None = None,
    n_jobs: int | None = None,
    client: Any = None,
    dtype: Any = None,
    key_added: str = _keys.NMF_PROJECT,
    copy: bool = False,
) -> AnnData | None:
    """Usages of the cells of ``adata`` on programmes fitted elsewhere (cNMF ``refit_usage``, starCAT ``fit_transform``).

    Each cell's usage is the non-negative least-squares fit ``argmin_{u >= 0} ||x D - u S||^2`` of its expression
    ``x`` on the reference's genes, scaled per gene by ``D`` as the reference's own matrix was before it was
    factorised, against the fixed programmes ``S``. Genes are matched by name. The cells are solved in row blocks of
    ``block_size`` (one block in memory at a time; a lazily read ``X`` is read block by block), on the CPU, the GPU
    or, with ``client=``, one Dask task per block with the programmes scattered once; for the same ``block_size``
    the usages are bit-identical in process and on a cluster, and CPU and GPU agree to rounding. Projecting the data a :func:`consensus_nmf` was fitted on onto its own
    programmes gives its usages (``obsm['X_nmf']``) back; projecting single cells onto programmes fitted on their
    metacells gives each cell its own usage instead of its metacell's.

    Parameters
    ----------
    adata
        The cells to project (cells x genes), holding the same kind of values as the reference's matrix (raw counts
        for cNMF-style programmes and starCAT references). Its ``X`` or ``layers[layer]`` may be lazy (dask).
    reference
        An AnnData after :func:`gpuc.tl.consensus_nmf` (programmes ``varm[key + '_spectra']`` over the genes
        ``uns[key]['genes']``, preprocessing from ``uns[key]['params']``), or a :class:`pandas.DataFrame` of genes
        (index) x programmes (columns), e.g. a starCAT reference file (tab-separated programmes x genes) read
        with :func:`pandas.read_csv` and transposed.
    key
        The ``key_added`` of the reference's :func:`consensus_nmf` (AnnData reference only).
    layer
        Query values: ``adata.layers[layer]``, or ``adata.X`` (``None``).
    preprocessing
        How the query genes are scaled: ``"sd"`` divides each gene by its standard deviation (cNMF, starCAT),
        ``"sqrt_sd"`` by its square root, ``"none"`` leaves the values. ``None``: the reference's
        (``params['preprocessing']`` of an AnnData reference; ``"sd"`` for a table, starCAT's convention).
    scale
        Whose standard deviations: ``"query"`` (default; starCAT's ``fit_transform``, which scales the query genes by
        the query's own SD, so a batch with another sequencing depth is put on the reference's scale) or
        ``"reference"`` (the SDs of the matrix the reference AnnData was fitted on, recomputed from its recorded
        ``layer``: the query then sees exactly the reference's transform). Unused with ``preprocessing="none"``;
        ``"reference"`` needs an AnnData reference whose matrix is still there.
    max_missing
        Largest fraction (in ``[0, 1)``) of the reference's genes that may be absent from ``adata.var_names``: any
        missing gene gives a warning with the fraction, more than this a :class:`ValueError` (default 0.2).
    normalize
        Also write the usages rescaled to sum 1 per cell (starCAT's default output, cNMF's ``norm_usage``).
    block_size
        Cells per block (each block is one task on a Dask cluster). Results depend on it only within ``tol``.
    max_iter
        HALS sweeps at most per block.
    tol
        A block stops when its loss changes by less than ``tol`` times its squared norm between checks.
    {device}
    {n_jobs}
    client
        A ``distributed.Client`` (or ``"default"``): one task per row block, the programmes scattered once; ``None``
        follows :attr:`gpuc.settings.client` (default: in this process).
    dtype
        Working precision (default float32; ``"float64"`` for parity with references to many digits).
    key_added
        ``obsm['X_' + key_added]``, ``obsm['X_' + key_added + '_normalized']``, ``uns[key_added]``.
    {copy}

    Returns
    -------
    ``None``, or a copy of ``adata`` with ``copy=True``. Sets

    ``adata.obsm['X_nmf_project']``
        Cells x k usages (float64), in the units of the scaled data as :func:`consensus_nmf`'s ``X_nmf``; equal to
        starCAT's ``fit_transform(..., return_unnormalized=True)`` usages up to its solver's convergence (and a
        common factor ``sqrt((n-1)/n)``: starCAT's SD has ``ddof=0``, gpuc's ``ddof=1``). Cells with no signal on the
        reference's genes get zeros.
    ``adata.obsm['X_nmf_project_normalized']``
        With ``normalize=True``: the usages divided by their sum per cell (starCAT's default ``fit_transform``
        output); zeros for cells without signal.
    ``adata.uns['nmf_project']``
        ``params`` (the call: ``reference`` is ``"anndata"`` or ``"table"``, ``reference_key`` the reference's
        ``key`` or ``None``, ``preprocessing`` as applied, ``scale``, ``layer``, ``max_missing``, ``normalize``,
        ``block_size``, ``max_iter``, ``tol``, ``dtype``, ``device``); ``programs`` (programme names, in the order of
        the usage columns); ``genes`` (the reference genes used, in the order of ``spectra``); ``spectra`` (genes
        used x k, the programmes as fitted); ``gene_scale`` (the per-gene multiplier ``D`` applied to the query);
        ``missing_genes``; ``n_genes_reference``; ``fraction_missing``; ``n_empty_cells`` (cells with no signal on
        the genes used); ``rel_error`` (``||X D - U S||^2 / ||X D||^2`` over all cells); ``n_blocks``; ``device``;
        ``dtype``; ``seconds``.

    Warns
    -----
    GpucWarning
        When reference genes are missing from ``adata`` (with the fraction), and when cells have no signal on the
        genes used.

    Raises
    ------
    ValueError
        Before anything is written: more than ``max_missing`` of the reference's genes missing (or none shared),
        negative or non-finite query values on the genes used, a reference that is not non-negative.
    """
    check_adata(adata)
    check_key_added(key_added)
    check_bool("copy", copy)
    check_bool("normalize", normalize)
    check_choice("scale", scale, SCALES)
    max_missing = check_number("max_missing", max_missing, low=0, high=1, high_open=True)
    block_size = check_int("block_size", block_size, minimum=1)
    max_iter = check_int("max_iter", max_iter, minimum=1)
    tol = check_number("tol", tol, low=0, low_open=True)
    ref, info = _reference_programmes(reference, key)
    if preprocessing is None:
        preprocessing = info.get("preprocessing", "sd")
    check_choice("preprocessing", preprocessing, PREPROCESSING)
    if scale == "reference" and preprocessing != "none" and not isinstance(reference, AnnData):
        msg = (
            "scale='reference' needs the reference's matrix, which a table of programmes does not carry; pass the "
            "reference AnnData, or scale='query' (starCAT's convention)."
        )
        raise ValueError(msg)
    _keys.check_not_foreign(
        adata, _keys.nmf_project_outputs(key_added), key_added, "gpuc.tl.nmf_project", _keys.NMF_PROJECT_MARKER
    )
    x = get_matrix(adata, layer=layer)
    cols, present, missing = _match_genes(adata, ref, max_missing)
    genes = ref.index[present]
    spectra = ref.to_numpy()[present].T  # (k, genes used)
    dask_client = resolve_client(client)
    work = float(x.shape[0]) * len(genes) * spectra.shape[0]
    backend = get_backend(device, None if is_dask_array(x) else x, tool="nmf", work=work)
    start = logg.info(
        f"projecting {x.shape[0]} cells onto {spectra.shape[0]} programmes over {len(genes)} genes "
        f"({runs_on(backend, dask_client)})"
    )
    t0 = time.perf_counter()
    # on the CPU an in-memory CSR query is cut to the reference's genes in one pass that also sums the genes' moments,
    # so the product reads only their values (bit-identical results; a lazy query is read block by block as it is)
    x, sel, moments = (
        select_genes(x, cols, block_rows=block_size, n_jobs=n_jobs) if backend.name == "cpu" else (x, cols, None)
    )
    if preprocessing == "none":
        factor = np.ones(len(genes))
    elif scale == "query":
        if moments is None:
            moments = gene_moments(x, sel, block_rows=block_size, client=dask_client)
        factor = gene_factors(moments, preprocessing)
    else:
        factor = gene_factors(
            _reference_moments(reference, genes, info.get("layer"), dask_client, block_size), preprocessing
        )
    options = ProjectOptions(backend.name, None if dtype is None else np.dtype(dtype), max_iter, tol)
    res = project(x, spectra, factor, genes=sel, block_rows=block_size, options=options, client=dask_client,
                  n_jobs=n_jobs)  # fmt: skip
    usages = res.usages
    sums = usages.sum(axis=1, keepdims=True)
    n_empty = int((sums[:, 0] <= 0).sum())
    if n_empty:
        msg = f"{n_empty} cell(s) have no signal on the {len(genes)} reference genes used; their usages are zero."
        warnings.warn(msg, GpucWarning, stacklevel=2)
    obsm = {_keys.nmf_usages(key_added): usages}
    if normalize:
        obsm[_keys.nmf_project_normalized(key_added)] = usages / np.where(sums > 0, sums, 1.0)
    params = {
        "reference": "anndata" if isinstance(reference, AnnData) else "table",
        "reference_key": key if isinstance(reference, AnnData) else None,
        "layer": layer,
        "preprocessing": preprocessing,
        "scale": scale,
        "max_missing": float(max_missing),
        "normalize": bool(normalize),
        "block_size": int(block_size),
        "max_iter": int(max_iter),
        "tol": float(tol),
        "dtype": None if dtype is None else str(np.dtype(dtype)),
        "device": device,
    }
    uns = {
        "params": params,
        "programs": np.asarray(ref.columns).astype(str),
        "genes": np.asarray(genes).astype(str),
        "spectra": np.ascontiguousarray(spectra.T),
        "gene_scale": np.asarray(factor, dtype=np.float64),
        "missing_genes": missing,
        "n_genes_reference": len(ref.index),
        "fraction_missing": float(len(missing) / len(ref.index)),
        "n_empty_cells": n_empty,
        "rel_error": res.rel_error,
        "n_blocks": res.n_blocks,
        "device": backend.name,
        "dtype": str(np.dtype(np.float32 if dtype is None else dtype)),
        "seconds": time.perf_counter() - t0,
    }
    adata = adata.copy() if copy else adata
    _write_projection(adata, key_added, obsm, uns)
    logg.info(
        "    finished", time=start, deep=f"added\n    'obsm[{_keys.nmf_usages(key_added)!r}]', 'uns[{key_added!r}]'"
    )
    return adata if copy else None
