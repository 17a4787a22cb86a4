"""Docstring fragments of the parameters that the NMF tools share (filled by :func:`gpuc._docs.doc_params`)."""

from __future__ import annotations

from gpuc._docs import DEVICE, N_JOBS, RANDOM_STATE

LAYER = """\
layer
    Layer to factorise (default ``adata.X``): raw counts with ``preprocessing="sd"`` for cNMF-style programmes,
    a log-normalised layer with ``"none"`` for bixverse-style ones. Must be finite and non-negative."""

MASK_VAR = """\
mask_var
    Genes to factorise: a boolean ``var`` column (``"highly_variable"``, the default, as left by
    :func:`scanpy.pp.highly_variable_genes`), a boolean array over genes (in ``var`` order), a boolean Series
    labelled by ``var_names`` (matched by name), or ``None`` for every gene."""

PREPROCESSING = """\
preprocessing
    ``"none"``, ``"sd"`` (divide each gene by its SD, ddof=1, no centring, as cNMF) or ``"sqrt_sd"``."""

METRIC = """\
metric
    Distance for the local density and the silhouette: ``"cosine"`` (1 - cos, default) or ``"euclidean"`` (cNMF,
    between the unit-norm components)."""

TARGET = """\
target
    Cluster the runs' ``"spectra"`` (gene space, cNMF, default) or ``"usage"`` columns (cell space; the consensus
    spectra are then refitted)."""

MAX_ITER_TOL = """\
max_iter, tol
    HALS iteration limit and tolerance: a run stops when its loss changed by less than ``tol * ||V||^2`` over the
    last 10 iterations (checked every 5).
    From identical random starts the defaults (``tol=1e-6, warmup=5``) give the restart-to-restart stability of
    cNMF's solver (scikit-learn coordinate descent); a looser ``tol`` is faster and slightly less stable (see
    the benchmarks page)."""

EXTRAPOLATE = """\
extrapolate
    Ang & Gillis extrapolation of the HALS iterates (per-run adaptive step with restarts) after the ``warmup``
    iterations: far fewer iterations than plain HALS. ``False`` gives plain HALS throughout."""

WARMUP = """\
warmup
    Iterations of plain HALS before the extrapolation starts. Which optimum a random start ends in is decided
    early; plain HALS there, from the usages first, lands in the same optima as cNMF's solver and gives its
    restart-to-restart stability, the extrapolation then converges fast. 0 extrapolates from the start."""

UPDATE_ORDER = """\
update_order
    ``"usages"``: the usages are updated first, from the random spectra, as scikit-learn's coordinate descent
    (cNMF's solver) does; ``"spectra"``: the spectra first (bixverse's order)."""

KMEANS_N_INIT = """\
kmeans_n_init
    k-means restarts for the consensus clustering."""

CLIENT = """\
client
    Where the restarts run: ``None`` follows :attr:`gpuc.settings.client` (default: in this process, all ranks
    in the same data products); ``"default"`` or a ``distributed.Client``: batches of restarts of each rank as
    Dask tasks (on sparse data several per rank, on dense data one per rank), the data scattered once to every
    worker; a k sweep then runs one consensus task per rank, :func:`consensus_nmf` its consensus in this
    process. Runs and results are identical wherever they run."""

DTYPE = """\
dtype
    Working precision of the data and factors: float32 (default, on both devices; losses are still accumulated
    in float64) or float64. With the default, values whose squares would overflow float32 (counts near 1e18)
    are fitted in float64, with a warning; ``dtype="float32"`` is then refused."""

# the runs of parameters that nmf_k_sweep and consensus_nmf both describe, in their docstrings' order: what is
# factorised, and how the restarts run
INPUT = "\n".join((LAYER, MASK_VAR, PREPROCESSING))
RESTARTS = "\n".join(
    (MAX_ITER_TOL, EXTRAPOLATE, WARMUP, UPDATE_ORDER, KMEANS_N_INIT, DEVICE, N_JOBS, CLIENT, DTYPE, RANDOM_STATE)
)

FRAGMENTS = {"input": INPUT, "metric": METRIC, "target": TARGET, "restarts": RESTARTS}
