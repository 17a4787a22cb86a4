"""What the safety measures of issue 41 add to a call: the input fingerprint, the name digests and the snapshot of
the all-or-nothing write (``gpuc._inputs``, ``gpuc._atomic``). Medians of 5 repeats, printed as a Markdown table.

Run: ``python benchmarks/safety_overhead.py``
"""

from __future__ import annotations

import time

import anndata as ad
import numpy as np
import scipy.sparse as sp

from gpuc._atomic import atomic_writes
from gpuc._inputs import matrix_fingerprint, names_digest


def median_seconds(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    x = sp.random(20_000, 2_000, density=0.1, format="csr", dtype=np.float32, random_state=0)
    dense = x.toarray()
    names = [f"cell{i}" for i in range(1_000_000)]
    a = ad.AnnData(sp.csr_matrix((100_000, 100), dtype=np.float32))
    for i in range(50):
        a.obs[f"c{i}"] = np.arange(100_000)
    for i in range(20):
        a.obsm[f"X{i}"] = np.zeros((100_000, 10))

    def swap() -> None:
        with atomic_writes(a):
            a.uns["x"] = 1

    rows = [
        (
            "matrix_fingerprint, 20,000 x 2,000 CSR float32, 4.0 M non-zeros",
            median_seconds(lambda: matrix_fingerprint(x)),
        ),
        (
            "matrix_fingerprint, the same matrix dense (40 M values)",
            median_seconds(lambda: matrix_fingerprint(dense), 3),
        ),
        (
            "one sparse product x @ v on that CSR matrix (for scale)",
            median_seconds(lambda: x @ np.ones(2_000, np.float32)),
        ),
        ("names_digest, 1,000,000 obs names", median_seconds(lambda: names_digest(names))),
        ("atomic_writes snapshot + swap, 100,000 cells, 50 obs columns, 20 obsm", median_seconds(swap)),
    ]
    print("| step | median seconds |\n| --- | --- |")
    for what, sec in rows:
        print(f"| {what} | {sec:.4f} |")


if __name__ == "__main__":
    main()
