"""Global settings: ``gpuc.settings.device``, CPU threads, the progress-bar and numba switches."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuc._device import DEVICES, Device


@dataclass
class _Settings:
    """Package-wide defaults.

    Attributes
    ----------
    device
        Default for every ``device=None`` argument: ``"auto"`` (GPU if usable, else CPU), ``"cpu"`` or ``"gpu"``.
    progress
        Show tqdm progress bars for long computations. Bars show only when this is True, Scanpy's verbosity is
        at its default (``warning``) or above, and the output is a terminal or a notebook; set it to False (or
        ``sc.settings.verbosity = 0``) to hide them.
    numba
        Run the CPU engines' numba-compiled kernels (default). ``False`` runs their array code instead, the code
        the GPU runs, on the CPU: slower, with the same results up to floating-point rounding. This is the one
        switch the tests use to compare the two.
    n_jobs
        Default for every ``n_jobs=None`` argument: the CPU threads of the compiled kernels, BLAS and FAISS. ``-1``
        (the default) takes gpuc's share of the machine: the cores available to the process (CPU affinity and
        cgroup CPU quota) less those that other processes keep busy when the call starts, at least one
        (:func:`gpuc._utils.share_of_cores`; on a busy machine more threads than free cores make a call slower than
        one thread). A positive int is that many threads, whatever the load; so is an explicit ``n_jobs=-1`` argument
        (all cores available to the process). Results do not depend on it (every parallel sum is merged in a fixed
        order).
    client
        Default for every ``client=None`` argument: where the independent units of a tool (groups of
        ``metacells``/``deseq``, ranks and restart batches of the NMF tools, gene blocks of one large DESeq2 fit)
        run. ``None`` (the default): one after the other in this process. ``"default"``: as Dask tasks on the active
        ``dask.distributed`` client (:func:`distributed.get_client`, the most recently created ``Client``). A
        ``distributed.Client``: on that client. Results are the same wherever the units run.
    """

    _device: Device = "auto"
    progress: bool = True
    numba: bool = True
    _n_jobs: int = -1
    client: Any = None

    @property
    def device(self) -> Device:
        """Default device: ``"auto"``, ``"cpu"`` or ``"gpu"``."""
        return self._device

    @device.setter
    def device(self, value: Device) -> None:
        if value not in DEVICES:
            msg = f"gpuc.settings.device must be one of {DEVICES}, got {value!r}."
            raise ValueError(msg)
        self._device = value

    @property
    def n_jobs(self) -> int:
        """Default CPU threads: ``-1`` (the cores available to the process and not busy with other work) or a positive
        int.
        """
        return self._n_jobs

    @n_jobs.setter
    def n_jobs(self, value: int) -> None:
        self._n_jobs = check_n_jobs(value, "gpuc.settings.n_jobs", allow_none=False)

    def __repr__(self) -> str:
        return (
            f"gpuc.settings(device={self._device!r}, n_jobs={self._n_jobs}, progress={self.progress}, "
            f"numba={self.numba}, client={self.client!r})"
        )


def check_n_jobs(value: object, name: str = "n_jobs", *, allow_none: bool = True) -> int | None:
    """``value`` if it is a valid ``n_jobs`` (``None`` where allowed, ``-1`` or a positive int), else raise.

    A non-integer (a bool included) is a ``TypeError``; ``0`` and negatives other than ``-1`` a ``ValueError``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        what = "None, -1 or a positive int" if allow_none else "-1 or a positive int"
        msg = f"{name} must be {what} (CPU threads; -1 for all cores), got {value!r}."
        raise TypeError(msg)
    if value != -1 and value < 1:
        msg = (
            f"{name}={value} is not valid: use -1 (all cores available to the process) or a positive number of threads."
        )
        raise ValueError(msg)
    return int(value)


settings = _Settings()


# ---------------------------------------------------------------------------------------------------------------------
# numba's OpenMP threads wait passively, whoever starts them

_NUMBA_PARALLEL = "numba.np.ufunc.parallel"


def passive_numba_launch(parallel: Any) -> None:
    """Make numba's thread-pool launcher (``numba.np.ufunc.parallel._launch_threads``) start OpenMP's threads with the
    passive wait policy, unless the user chose one (``OMP_WAIT_POLICY``).

    numba's OpenMP layer loads libgomp when its threads start, whichever library first runs a parallel numba function
    (scanpy's neighbours through pynndescent, UMAP, gpuc), and libgomp reads the policy then, once for the process.
    Without one, a libgomp thread that finishes its part of a parallel loop spins for 300,000 rounds
    (``GOMP_SPINCOUNT``) before it sleeps, taking a core from the threads still working and from other processes:
    with other jobs on the machine a parallel fit with many short loops is then many times slower than a serial one.
    Passive waiting costs a wake-up (microseconds) per parallel loop instead. The variable is set only while the
    threads start, so other OpenMP libraries and child processes never see it. Nothing when the launcher is
    already wrapped.
    """
    launch = getattr(parallel, "_launch_threads", None)
    if launch is None or getattr(launch, "_gpuc_passive", False):
        return

    @functools.wraps(launch)
    def launch_passive() -> Any:
        if getattr(parallel, "_is_initialized", True) or "OMP_WAIT_POLICY" in os.environ:
            return launch()
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            return launch()
        finally:
            os.environ.pop("OMP_WAIT_POLICY", None)

    launch_passive._gpuc_passive = True  # type: ignore[attr-defined]
    parallel._launch_threads = launch_passive


class _NumbaParallelHook(importlib.abc.MetaPathFinder):
    """Wraps numba's launcher (:func:`passive_numba_launch`) as soon as numba imports its thread-pool module, for
    numba imported after gpuc (importing numba here would cost its whole import time); then leaves the import system.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _NUMBA_PARALLEL:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: Any) -> None:
            exec_module(module)
            passive_numba_launch(module)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


def _hook_numba_launch() -> None:
    parallel = sys.modules.get(_NUMBA_PARALLEL)
    if parallel is not None:
        passive_numba_launch(parallel)
    elif not any(isinstance(f, _NumbaParallelHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _NumbaParallelHook())


_hook_numba_launch()
