"""Test support shipped with gpuc: a stand-in GPU so that CPU-only CI runs the GPU code path (:mod:`.standin`),
simulated data that the tests and the benchmarks share (:mod:`.simulated`) and the loaders of the R DESeq2
reference sets they compare with (:mod:`.deseq_refs`).
"""
