"""Every default AnnData key gpuc writes, in one place.

Each tool's ``key_added`` replaces its default prefix; the derived keys below are built from it, so renaming one
renames all of a tool's outputs consistently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# ---- names that come from the data ---------------------------------------------------------------------------------
# Group names and contrast levels become keys of ``uns`` dicts, which HDF5 and zarr store as names of groups or
# datasets. A "/" is read as a nested group, "." and ".." name the group itself or its parent, an empty name is
# refused, a NUL byte ends the name in HDF5, zarr refuses "\\" and keeps its own metadata in ".zattrs"/".zarray"/
# ".zgroup". So these characters are stored percent-encoded: "%" -> "%25" first, "/" -> "%2F", "\\" -> "%5C",
# NUL -> "%00", and a leading "." -> "%2E"; the empty name is stored as "%" alone, which no encoding otherwise gives.
# The encoding is reversible and two different names never share a key ("T/NK" -> "T%2FNK", "T_NK" stays, a literal
# "T%2FNK" -> "T%252FNK"); keys written by earlier versions (which encoded only "%" and "/") decode unchanged.
_ENCODE = {"%": "%25", "/": "%2F", "\\": "%5C", "\x00": "%00"}


def encode_name(name: Any) -> str:
    """The ``uns`` key under which a data-derived name (group, contrast) is stored; reversed by :func:`decode_name`."""
    text = str(name)
    if text == "":
        return "%"
    out = "".join(_ENCODE.get(c, c) for c in text)
    return "%2E" + out[1:] if out.startswith(".") else out


def decode_name(key: str) -> str:
    """The original name of a key written by :func:`encode_name`."""
    import re

    if key == "%":
        return ""
    return re.sub(r"%(25|2F|5C|00|2E)", lambda m: chr(int(m.group(1), 16)), key)


def drop_outputs(adata: Any, outputs: dict[str, list[str]]) -> None:
    """Delete the entries ``{slot: [names]}`` that exist in ``adata`` (``obs``/``var`` columns, ``obsm``, ``varm``,
    ``obsp``, ``layers``, ``uns`` keys), so that a rerun under the same key leaves nothing from the previous fit.
    """
    for slot, names in outputs.items():
        container = getattr(adata, slot)
        for name in names:
            if slot in ("obs", "var"):
                if name in container.columns:
                    del container[name]
            elif name in container:
                del container[name]


# ---- whose output is it --------------------------------------------------------------------------------------------
# A tool replaces its own earlier outputs under the same key, never another tool's output or the user's data that
# happen to sit under the names it would write (consensus_nmf(key_added="pca") would replace obsm["X_pca"];
# vst(key_added="counts") the raw counts). A key holds a tool's output when uns[key]["params"] has the tool's marker
# parameters (names only that tool records).
METACELL_MARKER = ("n_metacells", "use_rep", "fw_iters")
NMF_MARKER = ("k", "n_runs", "normalization", "neighborhood")
NMF_K_SWEEP_MARKER = ("k_range", "n_runs", "density_threshold")
DESEQ_MARKER = ("design", "contrast", "fit_type", "cooks_filter")
VST_MARKER = ("blind", "fit_type", "key")
NMF_PROJECT_MARKER = ("reference_key", "scale", "max_missing")
RLOG_MARKER = ("blind", "fit_type", "key", "beta_prior_var")
NORMALIZED_MARKER = ("fpm", "robust", "key")


def written_by(adata: Any, key: str, marker: tuple[str, ...]) -> bool:
    """Whether ``adata.uns[key]`` is the output of the tool whose ``params`` carry the names ``marker``."""
    entry = adata.uns.get(key) if hasattr(adata.uns, "get") else None
    params = entry.get("params") if hasattr(entry, "get") else None
    return hasattr(params, "keys") and all(m in params for m in marker)


def _gpuc_tool_of(adata: Any, key: str) -> str | None:
    """The gpuc tool whose result is stored at ``adata.uns[key]``, if any."""
    for tool, marker in (
        ("gpuc.tl.metacells", METACELL_MARKER),
        ("gpuc.tl.consensus_nmf", NMF_MARKER),
        ("gpuc.tl.nmf_k_sweep", NMF_K_SWEEP_MARKER),
        ("gpuc.tl.deseq", DESEQ_MARKER),
        ("gpuc.tl.rlog", RLOG_MARKER),  # before vst: its marker holds vst's
        ("gpuc.tl.vst", VST_MARKER),
        ("gpuc.tl.nmf_project", NMF_PROJECT_MARKER),
        ("gpuc.tl.normalized_counts", NORMALIZED_MARKER),
    ):
        if written_by(adata, key, marker):
            return tool
    return None


def check_not_foreign(adata: Any, outputs: dict[str, list[str]], key: str, tool: str, marker: tuple[str, ...]) -> None:
    """Raise a :class:`ValueError`, before anything is written, when ``tool`` writing under ``key`` would replace
    entries (``outputs``: ``{slot: [names]}``) that an earlier run of ``tool`` under ``key`` did not write.
    """
    if written_by(adata, key, marker):
        return
    other = _gpuc_tool_of(adata, key)
    present = []
    for slot, names in outputs.items():
        container = getattr(adata, slot)
        for name in names:
            if name in (container.columns if slot in ("obs", "var") else container):
                present.append((slot, f"adata.{slot}[{name!r}]"))
    if not present:
        return
    import warnings

    from gpuc._errors import GpucWarning

    where = ", ".join(p for _, p in present)
    if other is not None:
        # another gpuc tool's result under the key the user named for this one: replaced, and said so
        msg = f"{tool} with key_added={key!r} replaces the {other} result stored under that key ({where}); pass another key_added to keep both."
        warnings.warn(msg, GpucWarning, stacklevel=3)
        return
    msg = (
        f"{tool} with key_added={key!r} would overwrite {where}, which {tool} did not write under that key (the "
        f"data or another tool's output). Pass another key_added, or delete {'it' if len(present) == 1 else 'them'} "
        f"first if {'it' if len(present) == 1 else 'they'} may go."
    )
    raise ValueError(msg)


def _derived(template: str, doc: str) -> Callable[[str], str]:
    """The function giving a key derived from a tool's ``key_added``: ``template`` with ``{key}`` replaced by it."""

    def derived(key: str) -> str:
        return template.format(key=key)

    derived.__doc__ = doc
    return derived


# ---- metacells (gpuc.tl.metacells) ---------------------------------------------------------------------------------
METACELL = "metacell"  # obs[key] labels, uns[key] diagnostics

metacell_weights = _derived("{key}_weights", "``obsm`` key of the n x k soft assignments (A transposed).")
metacell_archetypes = _derived("{key}_archetypes", "``obsm`` key of the n x k archetype matrix B.")
metacell_kernel = _derived("{key}_kernel", "``obsp`` key of the SEACells kernel M.")
metacell_quality = _derived(
    "{key}_quality", "``uns`` key of the quality table written by :func:`gpuc.tl.metacell_quality`."
)


METACELL_SOURCE = "metacell_source"  # uns[key] of the AnnData returned by gpuc.tl.aggregate_metacells


def metacell_assignment_columns(key: str) -> dict[str, str]:
    """``obs`` columns of :func:`gpuc.tl.metacell_assignment_quality` (``key`` = its ``key_added``), by statistic."""
    return {"entropy": f"{key}_entropy", "max_weight": f"{key}_max_weight", "n_assigned": f"{key}_n_assigned"}


metacell_assignment_quality = _derived(
    "{key}_assignment_quality",
    "``uns`` key of the parameters of :func:`gpuc.tl.metacell_assignment_quality` (``key`` = its ``key_added``).",
)


def metacell_outputs(key: str) -> dict[str, list[str]]:
    """Everything :func:`gpuc.tl.metacells` writes under ``key``, and the default quality table derived from it."""
    return {
        "obs": [key, *metacell_assignment_columns(key).values()],
        "obsm": [metacell_weights(key), metacell_archetypes(key)],
        "obsp": [metacell_kernel(key)],
        "uns": [key, metacell_quality(key), metacell_assignment_quality(key)],
    }


# ---- consensus NMF (gpuc.tl.nmf_k_sweep / consensus_nmf) -----------------------------------------------------------
NMF_K_SWEEP = "nmf_k_sweep"  # uns[key]
NMF = "nmf"  # uns[key]

nmf_usages = _derived("X_{key}", "``obsm`` key of the cells x k usages (``X_nmf`` for the default key).")
nmf_spectra = _derived("{key}_spectra", "``varm`` key of the genes x k programmes.")
nmf_usages_refit = _derived(
    "X_{key}_refit",
    "``obsm`` key of cNMF's final usages (refitted on the TPM of the factorised genes; ``X_nmf_refit``).",
)
nmf_spectra_tpm = _derived("{key}_spectra_tpm", "``varm`` key of cNMF's TPM spectra over every gene (genes x k).")
nmf_spectra_score = _derived(
    "{key}_spectra_score", "``varm`` key of cNMF's z-score spectra over every gene (genes x k)."
)


def nmf_outputs(key: str) -> dict[str, list[str]]:
    """Everything :func:`gpuc.tl.consensus_nmf` writes under ``key``."""
    return {
        "obsm": [nmf_usages(key), nmf_usages_refit(key)],
        "varm": [nmf_spectra(key), nmf_spectra_tpm(key), nmf_spectra_score(key)],
        "uns": [key],
    }


# ---- usages on fixed programmes (gpuc.tl.nmf_project) -------------------------------------------------------------
NMF_PROJECT = "nmf_project"  # obsm[f"X_{key}"], obsm[f"X_{key}_normalized"], uns[key]

nmf_project_normalized = _derived(
    "X_{key}_normalized", "``obsm`` key of the usages rescaled to sum 1 per cell (written with ``normalize=True``)."
)


def nmf_project_outputs(key: str) -> dict[str, list[str]]:
    """Everything :func:`gpuc.tl.nmf_project` writes under ``key``."""
    return {"obsm": [nmf_usages(key), nmf_project_normalized(key)], "uns": [key]}


# ---- DESeq2 (gpuc.tl.deseq) ------------------------------------------------------------------------------------------
DESEQ = "deseq"  # uns[key]; obs[f"{key}_size_factors"]; var[f"{key}_<field>"]; varm[f"{key}_coef"]

deseq_size_factors = _derived("{key}_size_factors", "``obs`` key of the size factors.")


def deseq_var(key: str, field: str) -> str:
    """``var`` column of a per-gene fit field (baseMean, dispersion stages, flags)."""
    return f"{key}_{field}"


deseq_coef = _derived(
    "{key}_coef", "``varm`` key of the genes x coefficients matrix (natural-log scale is never stored; log2 like R)."
)
deseq_coef_cov = _derived(
    "{key}_coef_cov", "``varm`` key of the coefficients' covariance (log2 scale, flattened p x p per gene)."
)
deseq_cooks = _derived("{key}_cooks", "``layers`` key of the Cook's distances.")


# per-gene fit fields written to ``var`` (one column each) or, with groupby, to each group's ``genes`` table
DESEQ_GENE_FIELDS = (
    "baseMean",
    "baseVar",
    "allZero",
    "dispGeneEst",
    "dispGeneConv",
    "dispFit",
    "dispMAP",
    "dispMAPConv",
    "dispOutlier",
    "dispersion",
    "betaConv",
    "betaIter",
    "deviance",
    "maxCooks",
    "replace",
    "refitted",
)


def deseq_outputs(key: str) -> dict[str, list[str]]:
    """Everything :func:`gpuc.tl.deseq` writes under ``key`` (with or without groupby)."""
    return {
        "obs": [deseq_size_factors(key)],
        "var": [deseq_var(key, f) for f in DESEQ_GENE_FIELDS],
        "varm": [deseq_coef(key), deseq_coef_cov(key)],
        "layers": [deseq_cooks(key)],
        "uns": [key],
    }


PSEUDOBULK = "pseudobulk"  # uns[key] of the AnnData returned by gpuc.tl.pseudobulk
# the quality-control fields of gpuc.tl.pseudobulk, named as decoupler's pp.pseudobulk names them, so that decoupler's
# pp.filter_samples / filter_by_prop and pl.filter_samples / filter_by_prop read them
PSBULK_CELLS = "psbulk_cells"  # obs: cells summed into each profile
PSBULK_COUNTS = "psbulk_counts"  # obs: total count of each profile (all genes)
PSBULK_PROPS = "psbulk_props"  # layers: per profile and gene, the fraction of its cells with a non-zero count

VST = "vst"  # layers[key] and uns[key] of gpuc.tl.vst


def vst_outputs(key: str) -> dict[str, list[str]]:
    """Everything :func:`gpuc.tl.vst` writes under ``key``."""
    return {"layers": [key], "uns": [key]}


RLOG = "rlog"  # layers[key], var[f"{key}_intercept"] and uns[key] of gpuc.tl.rlog

rlog_intercept = _derived(
    "{key}_intercept",
    "``var`` column of the fitted log2 intercept of :func:`gpuc.tl.rlog` (R's ``mcols(rld)$rlogIntercept``).",
)


def rlog_outputs(key: str) -> dict[str, list[str]]:
    """Everything :func:`gpuc.tl.rlog` writes under ``key``."""
    return {"layers": [key], "var": [rlog_intercept(key)], "uns": [key]}


NORMALIZED = "normalized"  # layers[key] and uns[key] of gpuc.tl.normalized_counts (fpm=False)
FPM = "fpm"  # the same with fpm=True


def normalized_outputs(key: str) -> dict[str, list[str]]:
    """Everything :func:`gpuc.tl.normalized_counts` writes under ``key``."""
    return {"layers": [key], "uns": [key]}
