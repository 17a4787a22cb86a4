"""Test support shipped with gpuc: a stand-in GPU so that CPU-only CI runs the GPU code path (:mod:`.standin`), and
simulated data that the tests and the benchmarks share (:mod:`.simulated`).
"""
