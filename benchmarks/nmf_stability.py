"""Consensus NMF stability, gpuc against cNMF's solver (not timed; the speed comparison is ``bench_nmf.py``).

On bundled pbmc3k with cNMF's own 2,000 over-dispersed genes and cNMF's matrix recipe (raw counts on the HVGs divided
by the gene SD, no centring):

* ``stability``: the k=2..12 x 10-run stability over ``--stability-sets`` seed sets. cNMF's factorisations are
  reproduced by scikit-learn's ``cd`` solver with cNMF's own settings and seed scheme (``np.random.seed(14 + i)``,
  one ``randint(1, 2**31 - 1)`` per (k, run) in sorted-k order; this reproduces cnmf 1.7.1's ``factorize`` exactly)
  and scored with cNMF's k-selection rule (``KMeans(k, n_init=10, random_state=1)`` and the Euclidean silhouette of
  the unit spectra); gpuc is ``tl.nmf_k_sweep(..., random_state=i)``. Also, for ``--agree-sets`` seed sets: from the
  *same* random starts, the fraction of runs in which gpuc's HALS and sklearn's ``cd`` end in the same optimum
  (relative errors within 2e-5).
* ``paired`` (``--paired-sets``): for each seed set and k, gpuc's 10 random starts (``random_init`` with
  ``derive_seed(i, k, run)``, sklearn's distribution) are fitted by both gpuc's default HALS schedule and
  scikit-learn's ``cd`` (cNMF's solver and settings, ``init="custom"``); both sets of fits go through the same
  consensus scoring, so the stability difference is the solver's alone.

Stability is the Euclidean silhouette of the pooled unit spectra without density filter (cNMF's k-selection number).
BLAS and numba are pinned to ``--threads`` threads (default 1).

    python benchmarks/nmf_stability.py --cases stability,paired

Writes ``nmf_stability.json`` and ``nmf_stability.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", default="stability,paired")
    p.add_argument("--stability-sets", type=int, default=8, help="seed sets of the stability case")
    p.add_argument("--agree-sets", type=int, default=2, help="seed sets of the same-start optimum agreement check")
    p.add_argument("--paired-sets", type=int, default=8, help="seed sets of the paired case")
    p.add_argument("--stability-ks", default="2-12", help="ranks of the stability case, 'a-b' (cNMF seeds assume 2-12)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    return p.parse_args()


ARGS = _args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import scanpy as sc  # noqa: E402
import scipy.sparse as sp  # noqa: E402

import gpuc  # noqa: E402
from gpuc._backend import get_backend  # noqa: E402
from gpuc._utils import derive_seed  # noqa: E402
from gpuc.nmf._hals import Operator, fit_hals  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

warnings.filterwarnings("ignore")
gpuc.settings.progress = False
sc.settings.verbosity = 0


# the gpuc HALS schedules compared with sklearn cd in the stability case
SCHEDULES = {"default": {}, "spectra first, no warm-up": {"update_order": "spectra", "warmup": 0}}


def load_pbmc3k() -> sc.AnnData:
    ad = gpuc.datasets.pbmc3k()
    sc.pp.filter_cells(ad, min_genes=200)
    ad = ad[ad.obs["passed_seurat_qc"].astype(bool)].copy()
    ad.X = ad.layers["counts"].astype(np.float32)
    return ad


def sklearn_cd(x: sp.csr_matrix, n2: float, k: int, **kw: object) -> tuple[np.ndarray, np.ndarray, float]:
    """One scikit-learn ``cd`` fit with cNMF 1.7.1's settings: ``(W, H, relative error)``."""
    from sklearn.decomposition import non_negative_factorization

    w, h, _ = non_negative_factorization(
        x,
        n_components=k,
        solver="cd",
        beta_loss="frobenius",
        tol=1e-4,
        max_iter=1000,
        alpha_W=0.0,
        alpha_H=0.0,
        l1_ratio=0.0,
        **kw,
    )
    return w, h, float(n2 - 2 * (w * (x @ h.T)).sum() + ((w.T @ w) * (h @ h.T)).sum()) / n2


def stability_case(ad: sc.AnnData, genes: list[str], n_sets: int, n_agree: int) -> dict:
    """Stability over many seed sets: cNMF's solver (sklearn cd, cNMF's seeds and k-selection rule) vs gpuc."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    from gpuc.nmf._hals import random_init
    from gpuc.tl._nmf import _prepare_block

    lo, hi = (int(v) for v in ARGS.stability_ks.split("-"))
    ks, n_runs = list(range(lo, hi + 1)), 10
    ad = ad.copy()
    ad.var["highly_variable"] = ad.var_names.isin(genes)
    block, _ = _prepare_block(ad, "counts", "highly_variable", "sd")  # cNMF's matrix: HVG counts / SD (ddof=1)
    x = sp.csr_matrix(block, dtype=np.float64)
    n2 = float(x.multiply(x).sum())

    def sk_fit(k: int, **kw: object) -> tuple[np.ndarray, float]:
        _, h, rel = sklearn_cd(x, n2, k, **kw)
        return h, rel

    out: dict = {
        "k": ks,
        "n_sets": n_sets,
        "cnmf_solver": {k: [] for k in ks},
        **{f"gpuc {n}": {k: [] for k in ks} for n in SCHEDULES},
    }
    for i in range(n_sets):
        # cNMF's scheme (cnmf.prepare: np.random.seed(seed); randint): one seed per (k, run), sorted k
        seeds = np.random.RandomState(14 + i).randint(1, 2**31 - 1, size=len(ks) * n_runs)
        t = time.perf_counter()
        for j, k in enumerate(ks):
            spectra = np.concatenate(
                [sk_fit(k, init="random", random_state=int(seeds[j * n_runs + r]))[0] for r in range(n_runs)]
            )
            unit = spectra / np.linalg.norm(spectra, axis=1, keepdims=True)
            labels = KMeans(n_clusters=k, n_init=10, random_state=1).fit(unit).labels_
            out["cnmf_solver"][k].append(float(silhouette_score(unit, labels, metric="euclidean")))
        t_sk = time.perf_counter() - t
        for name, kw in SCHEDULES.items():
            b = ad.copy()
            gpuc.tl.nmf_k_sweep(
                b,
                ks,
                n_runs=n_runs,
                layer="counts",
                preprocessing="sd",
                metric="euclidean",
                density_threshold=2.0,
                device="cpu",
                random_state=i,
                **kw,
            )
            tab = b.uns["nmf_k_sweep"]["table"]
            for k, v in zip(tab.k.astype(int), tab.stability.astype(float), strict=True):
                out[f"gpuc {name}"][k].append(v)
        print(
            f"[stability set {i}] sklearn cd {t_sk:.0f} s; "
            + "; ".join(
                f"{n}: " + " ".join(f"{out[n][k][-1]:.3f}" for k in ks) for n in out if n not in ("k", "n_sets")
            ),
            flush=True,
        )
    # same starts: does each gpuc run end in the optimum sklearn's cd reaches from the same (W0, H0)?
    be = get_backend("cpu")
    op = Operator.build(be, block)
    agree = {name: {k: [] for k in ks} for name in SCHEDULES}
    for i in range(n_agree):
        for k in ks:
            seeds = [derive_seed(i, k, r) for r in range(n_runs)]
            w0, h0 = random_init(seeds, op.shape[0], op.shape[1], k, op.mean, np.float64)
            ref = np.array(
                [sk_fit(k, init="custom", W=w0[:, r, :].copy(), H=h0[:, r, :].T.copy())[1] for r in range(n_runs)]
            )
            for name, kw in SCHEDULES.items():
                rel = fit_hals(be, op, k, seeds, **kw).rel_errors
                agree[name][k] += (np.abs(rel - ref) < 2e-5).tolist()
        print(
            f"[agreement set {i}] "
            + "; ".join(f"{n}: {np.mean([v for k in ks for v in agree[n][k]]):.2f}" for n in SCHEDULES),
            flush=True,
        )
    out["agreement"] = {
        name: {k: float(np.mean(v)) if v else float("nan") for k, v in d.items()} for name, d in agree.items()
    }
    out["agree_sets"] = n_agree
    return out


def paired_case(ad: sc.AnnData, genes: list[str], n_sets: int) -> dict:
    """Stability of gpuc's default HALS and sklearn cd fitted from the same random starts, scored identically."""

    from gpuc.nmf._consensus import sweep_row
    from gpuc.nmf._hals import HalsResult, random_init
    from gpuc.nmf._plan import backend_and_op
    from gpuc.tl._nmf import _prepare_block

    lo, hi = (int(v) for v in ARGS.stability_ks.split("-"))
    ks, n_runs = list(range(lo, hi + 1)), 10
    ad = ad.copy()
    ad.var["highly_variable"] = ad.var_names.isin(genes)
    block, _ = _prepare_block(ad, "counts", "highly_variable", "sd")
    be, op = backend_and_op(block, "cpu", None)  # what tl.nmf_k_sweep fits (float32)
    x = sp.csr_matrix(block, dtype=np.float64)
    n2 = float(x.multiply(x).sum())
    score = {
        "target": "spectra",
        "metric": "euclidean",
        "density_threshold": 2.0,
        "kmeans_n_init": 10,
        "random_state": 0,
    }
    out: dict = {
        "k": ks,
        "n_sets": n_sets,
        "sklearn": {k: [] for k in ks},
        "gpuc": {k: [] for k in ks},
        "same_optimum": {k: [] for k in ks},
    }
    for i in range(n_sets):
        t = time.perf_counter()
        for k in ks:
            seeds = [derive_seed(i, k, r) for r in range(n_runs)]
            w0, h0 = random_init(seeds, op.shape[0], op.shape[1], k, op.mean, np.float64)
            ws, hs, losses = [], [], []
            for r in range(n_runs):
                w, h, rel = sklearn_cd(x, n2, k, init="custom", W=w0[:, r, :].copy(), H=h0[:, r, :].T.copy())
                nrm = np.linalg.norm(w, axis=0)
                nrm[nrm == 0] = 1.0
                w, h = w / nrm, h * nrm[:, None]
                ws.append(w)
                hs.append(h.T)
                losses.append(rel * n2)
            skf = HalsResult(
                np.stack(ws, 1).astype(np.float32),
                np.stack(hs, 1).astype(np.float32),
                np.asarray(losses),
                np.zeros(n_runs, int),
                np.ones(n_runs, bool),
                n2,
            )
            gf = fit_hals(be, op, k, seeds)
            out["sklearn"][k].append(float(sweep_row(be, op, skf, k, **score).stability))
            out["gpuc"][k].append(float(sweep_row(be, op, gf, k, **score).stability))
            out["same_optimum"][k].append(
                float(np.mean(np.abs(np.asarray(gf.rel_errors) - np.asarray(skf.rel_errors)) < 2e-5))
            )
        print(
            f"[paired set {i}] {time.perf_counter() - t:.0f} s; gpuc - sklearn: "
            + " ".join(f"{k}:{out['gpuc'][k][-1] - out['sklearn'][k][-1]:+.3f}" for k in ks),
            flush=True,
        )
    return out


def _paired_markdown(pr: dict, machine: str) -> str:
    ks = pr["k"]
    lines = [
        machine,
        "",
        f"**Paired stability, k={ks[0]}..{ks[-1]} x 10 runs, {pr['n_sets']} seed sets: gpuc default HALS and sklearn cd (cNMF's solver) from the same random starts, same consensus scoring**",
        "",
    ]
    lines += [
        "| k | sklearn cd (mean) | gpuc (mean) | gpuc - sklearn: mean [min, max] over sets | sets with gpuc >= sklearn - 0.005 | runs in the same optimum |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in ks:
        a = np.asarray(pr["sklearn"].get(k, pr["sklearn"].get(str(k))))
        g = np.asarray(pr["gpuc"].get(k, pr["gpuc"].get(str(k))))
        same = np.asarray(pr["same_optimum"].get(k, pr["same_optimum"].get(str(k))))
        d = g - a
        lines.append(
            f"| {k} | {a.mean():.3f} | {g.mean():.3f} | {d.mean():+.3f} [{d.min():+.3f}, {d.max():+.3f}] | {(d >= -0.005).sum()}/{len(d)} | {same.mean():.2f} |"
        )
    return "\n".join(lines) + "\n"


def _stability_markdown(st: dict) -> list[str]:
    ks = st["k"]
    tools = [t for t in st if t == "cnmf_solver" or t.startswith("gpuc ")]
    lines = [
        f"**Stability, k=2..12 x 10 runs, over {st['n_sets']} seed sets** (mean / median [min-max]; cNMF = sklearn cd with cNMF's seeds and k-selection rule):",
        "",
    ]
    lines += [
        "| k | " + " | ".join("cNMF" if t == "cnmf_solver" else t for t in tools) + " | gpuc default - cNMF (means) |",
        "| --- |" + " --- |" * (len(tools) + 1),
    ]
    for k in ks:
        cells = []
        for t in tools:
            v = np.asarray(st[t][k] if k in st[t] else st[t][str(k)])
            cells.append(f"{v.mean():.3f} / {np.median(v):.3f} [{v.min():.3f}-{v.max():.3f}]")
        c = np.asarray(st["cnmf_solver"].get(k, st["cnmf_solver"].get(str(k))))
        g = np.asarray(st["gpuc default"].get(k, st["gpuc default"].get(str(k))))
        cells.append(f"{g.mean() - c.mean():+.3f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("")
    if st.get("agree_sets"):
        lines += [
            f"Same random starts ({st['agree_sets']} seed sets x 10 runs per k): fraction of runs ending in the optimum sklearn's cd reaches:",
            "",
        ]
        lines += ["| schedule | " + " | ".join(str(k) for k in ks) + " | all |", "| --- |" + " --- |" * (len(ks) + 1)]
        for name, d in st["agreement"].items():
            vals = [d.get(k, d.get(str(k))) for k in ks]
            lines.append(f"| gpuc {name} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {np.mean(vals):.2f} |")
        lines.append("")
    return lines


def cnmf_genes(ad: sc.AnnData, tmp: str) -> list[str]:
    """cNMF's 2,000 over-dispersed genes of ``ad``'s counts (its ``prepare`` step only)."""
    from cnmf import cNMF

    counts_fn = str(Path(tmp) / "pbmc3k_counts.h5ad")
    sc.AnnData(ad.layers["counts"].astype(np.float32), obs=ad.obs[[]], var=ad.var[[]]).write_h5ad(counts_fn)
    obj = cNMF(output_dir=str(Path(tmp) / "hvg"), name="hvg")
    obj.prepare(counts_fn=counts_fn, components=[2], n_iter=4, seed=14, num_highvar_genes=2000)
    return open(obj.paths["nmf_genes_list"]).read().split()


def main() -> None:
    out_dir = Path(ARGS.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = ARGS.cases.split(",")
    ad = load_pbmc3k()
    res: dict = {"kind": "nmf_stability", "machine": _harness.machine(), "threads": ARGS.threads,
                 "load_before": _harness.loadavg()}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        genes = cnmf_genes(ad, tmp)
    machine = f"Machine: {_harness.machine_line(res['machine'])}; threads {ARGS.threads}."
    md = [] if "paired" in cases else [machine, ""]
    if "paired" in cases:
        res["paired"] = paired_case(ad, genes, ARGS.paired_sets)
        md.append(_paired_markdown(res["paired"], machine))
    if "stability" in cases:
        res["stability"] = stability_case(ad, genes, ARGS.stability_sets, ARGS.agree_sets)
        md += _stability_markdown(res["stability"])
    res["load_after"] = _harness.loadavg()
    (out_dir / "nmf_stability.json").write_text(json.dumps(res, indent=2, default=float))
    (out_dir / "nmf_stability.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
