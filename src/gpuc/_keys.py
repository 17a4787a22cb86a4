"""Every default AnnData key gpuc writes, in one place.

Each tool's ``key_added`` replaces its default prefix; the derived keys below are built from it, so renaming one
renames all of a tool's outputs consistently.
"""

from __future__ import annotations

# ---- metacells (gpuc.tl.metacells) ---------------------------------------------------------------------------------
METACELL = "metacell"  # obs[key] labels, uns[key] diagnostics


def metacell_weights(key: str) -> str:
    """``obsm`` key of the n x k soft assignments (A transposed)."""
    return f"{key}_weights"


def metacell_archetypes(key: str) -> str:
    """``obsm`` key of the n x k archetype matrix B."""
    return f"{key}_archetypes"


def metacell_kernel(key: str) -> str:
    """``obsp`` key of the SEACells kernel M."""
    return f"{key}_kernel"


def metacell_quality(key: str) -> str:
    """``uns`` key of the quality table written by :func:`gpuc.tl.metacell_quality`."""
    return f"{key}_quality"


# ---- consensus NMF (gpuc.tl.nmf_k_sweep / consensus_nmf) -----------------------------------------------------------
NMF_K_SWEEP = "nmf_k_sweep"  # uns[key]
NMF = "nmf"  # uns[key]


def nmf_usages(key: str) -> str:
    """``obsm`` key of the cells x k usages (``X_nmf`` for the default key)."""
    return f"X_{key}"


def nmf_spectra(key: str) -> str:
    """``varm`` key of the genes x k programmes."""
    return f"{key}_spectra"


# ---- DESeq2 (gpuc.tl.deseq) ------------------------------------------------------------------------------------------
DESEQ = "deseq"  # uns[key]; obs[f"{key}_size_factors"]; var[f"{key}_<field>"]; varm[f"{key}_coef"]


def deseq_size_factors(key: str) -> str:
    """``obs`` key of the size factors."""
    return f"{key}_size_factors"


def deseq_var(key: str, field: str) -> str:
    """``var`` column of a per-gene fit field (baseMean, dispersion stages, flags)."""
    return f"{key}_{field}"


def deseq_coef(key: str) -> str:
    """``varm`` key of the genes x coefficients matrix (natural-log scale is never stored; log2 like R)."""
    return f"{key}_coef"
