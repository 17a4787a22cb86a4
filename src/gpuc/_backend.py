"""The one place that knows about devices: numpy/scipy/faiss-cpu on the CPU, CuPy/cupyx on NVIDIA GPUs.

Engines receive a :class:`Backend` and write their maths once against ``backend.xp`` (numpy or cupy),
``backend.sparse`` (scipy.sparse or cupyx.scipy.sparse) and ``backend.special``. What the two stacks do not share
(kNN, batched solves, host/device transfers) is a method here with a CPU twin.

Nothing here imports cupy, cupyx or faiss at module import time: ``import gpuc`` works on a machine without them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import math
import warnings
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg
import scipy.special

from gpuc._device import DEVICES, Device
from gpuc._errors import GpucWarning
from gpuc._numpy_compat import restore_row_stack, row_stack_shimmed
from gpuc._settings import settings
from gpuc._utils import current_n_jobs

GPU_EXTRA_HINT = (
    "pip install 'gpuc[gpu-cu12]' (or 'gpuc[gpu-cu13]' for CUDA 13; gpuc is not on PyPI yet, so from a gpuc "
    "checkout: pip install '.[gpu-cu12]')"
)


# --------------------------------------------------------------------------------------------------------------------
# optional imports
# --------------------------------------------------------------------------------------------------------------------
def optional_import(module: str, extra: str, purpose: str = "") -> ModuleType:
    """Import an optional dependency or raise an :class:`ImportError` naming the gpuc extra that provides it.

    ``extra="gpu"`` names the CUDA extras (``gpu-cu12`` / ``gpu-cu13``, see :data:`GPU_EXTRA_HINT`); any other value
    is the name of the extra itself.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        what = f" for {purpose}" if purpose else ""
        install = (
            GPU_EXTRA_HINT if extra == "gpu" else f"pip install 'gpuc[{extra}]' (from a gpuc checkout: '.[{extra}]')"
        )
        msg = f"{module!r} is needed{what} but could not be imported ({err}). Install it with: {install}"
        raise ImportError(msg) from err


@functools.cache
def gpu_status() -> tuple[bool, str]:
    """Return ``(usable, reason)``: whether cupy imports and sees at least one CUDA device."""
    try:
        import cupy
    except Exception as err:
        return False, f"cupy is not installed or failed to import ({type(err).__name__}: {err})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:
        return False, f"cupy imported but no CUDA device is usable ({type(err).__name__}: {err})"
    if n < 1:
        return False, "cupy imported but reports 0 CUDA devices"
    return True, f"{n} CUDA device(s)"


def gpu_available() -> bool:
    """Whether a CUDA device can be used through cupy."""
    return gpu_status()[0]


# --------------------------------------------------------------------------------------------------------------------
# the fused GPU kernels (numba-cuda): usable in this process?
# --------------------------------------------------------------------------------------------------------------------
class FusedKernelsWarning(GpucWarning):
    """numba-cuda is installed but cannot compile gpuc's fused GPU kernels here: the GPU path runs its CuPy array
    code instead (the same results, more kernel launches).
    """


def _probe_kernel(x: Any) -> None:  # pragma: no cover - compiled by the probe
    x[0] = x[0] * 2.0 + 1.0


def _probe_cuda_compiler() -> str | None:
    """``None`` when numba-cuda can compile a kernel in this process, else why not.

    Importing ``numba.cuda`` is not enough: numba-cuda loads its compiler's modules on the first compilation, and
    those can fail against a newer numpy (numba-cuda 0.30 with numpy 2.5: ``np.row_stack`` is gone, which
    :mod:`gpuc._numpy_compat` restores) or without the CUDA compiler libraries (libNVVM). With a CUDA device the probe
    compiles for that device (the compiler of the kernels' first launch); without one, PTX for sm_80, so that
    ``gpuc info`` on a machine without a GPU still says whether the installed toolchain can build the kernels. Under
    the CUDA simulator nothing is compiled.
    """
    restore_row_stack()  # before numba-cuda's compiler modules are first imported
    try:
        import numba
        from numba import cuda
    except Exception as err:  # whatever the failure, the answer is the same: no fused kernels
        return f"numba-cuda could not be imported ({type(err).__name__}: {err})"
    if numba.config.ENABLE_CUDASIM:
        return None
    try:
        on_device = bool(cuda.is_available())
    except Exception:
        on_device = False
    current = getattr(cuda, "compile_ptx_for_current_device", None)
    try:
        if on_device and current is not None:
            current(_probe_kernel, (numba.types.float64[::1],))
        else:
            cuda.compile_ptx(_probe_kernel, (numba.types.float64[::1],), cc=(8, 0))
    except Exception as err:
        return f"numba-cuda cannot compile a kernel ({type(err).__name__}: {str(err).strip()})"
    return None


def _versions() -> str:
    from importlib import metadata

    out = []
    for dist in ("numba-cuda", "numba", "numpy"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} not installed")
    return ", ".join(out)


@functools.cache
def fused_kernels_status() -> tuple[bool, str]:
    """Whether gpuc's fused GPU kernels (numba-cuda) can be built in this process, and why not.

    Probed once per process (a tiny kernel is compiled; nothing runs) and cached. When they cannot, a
    :class:`FusedKernelsWarning` names the cause, the versions and what to install, once; the engines (metacells,
    NMF, DESeq2) then run their CuPy array code, which gives the same results with many more launches. The engines
    ask :func:`fused_kernels_usable` before they choose the kernels; ``gpuc info`` prints this status and
    ``gpuc info --require-fused`` fails when it is off (the GPU check script stops there).
    """
    reason = _probe_cuda_compiler()
    if reason is None:
        shim = " (numpy lacks np.row_stack: gpuc restored it for numba-cuda, see gpuc._numpy_compat)"
        return True, f"numba-cuda compiles kernels [{_versions()}]{shim if row_stack_shimmed() else ''}"
    if "has no attribute" in reason and "numpy" in reason:
        fix = (
            "install a numpy that this numba-cuda supports (pip install 'numpy<2.5') or a numba-cuda release that "
            "supports this numpy (pip install -U numba-cuda)"
        )
    elif "could not be imported" in reason:
        fix = f"install numba-cuda with the GPU extra of your CUDA version: {GPU_EXTRA_HINT}"
    else:
        fix = (
            "install numba-cuda with the CUDA compiler libraries (libNVVM, NVRTC) of your CUDA version, which the "
            f"GPU extras bring as NVIDIA's wheels: {GPU_EXTRA_HINT}; check with: gpuc info"
        )
    msg = (
        f"gpuc's fused GPU kernels are off in this process: {reason} [{_versions()}]. The GPU path runs its CuPy "
        f"array code instead (same results, slower: many more kernel launches). To use the kernels, {fix}."
    )
    warnings.warn(msg, FusedKernelsWarning, stacklevel=2)
    return False, msg


def fused_kernels_usable() -> bool:
    """Whether the GPU engines may use their numba-cuda kernels (see :func:`fused_kernels_status`)."""
    return fused_kernels_status()[0]


# Array types of other device namespaces that behave as CuPy's (the stand-in GPU of gpuc._testing.standin, which
# CPU CI uses to run the GPU code path): (dense types, sparse types).
_EXTRA_DEVICE_TYPES: tuple[tuple[type, ...], tuple[type, ...]] = ((), ())


def register_device_types(*, dense: type, sparse: type) -> None:
    """Treat ``dense`` / ``sparse`` instances as device arrays (like cupy / cupyx ones) in :func:`is_cupy_array`,
    :func:`is_sparse` and :func:`to_host` (their ``.get()`` returns the host copy, as CuPy's does).
    """
    global _EXTRA_DEVICE_TYPES
    d, s = _EXTRA_DEVICE_TYPES
    _EXTRA_DEVICE_TYPES = ((*d, dense) if dense not in d else d, (*s, sparse) if sparse not in s else s)


def is_cupy_array(x: Any) -> bool:
    """Whether ``x`` lives on the GPU: a cupy ndarray or a cupyx sparse matrix (checked without importing cupy)."""
    if type(x).__module__.startswith("cupy"):
        return True
    dense, sparse = _EXTRA_DEVICE_TYPES
    return bool(dense or sparse) and isinstance(x, dense + sparse)


def is_sparse(x: Any) -> bool:
    """Whether ``x`` is a scipy or cupyx sparse matrix/array."""
    if sp.issparse(x):
        return True
    if type(x).__module__.startswith("cupyx.scipy.sparse"):
        return True
    return bool(_EXTRA_DEVICE_TYPES[1]) and isinstance(x, _EXTRA_DEVICE_TYPES[1])


# --------------------------------------------------------------------------------------------------------------------
# device resolution
# --------------------------------------------------------------------------------------------------------------------
# device="auto" with the data in host memory: below these sizes gpuc's CPU path was measured faster than its GPU path,
# so "auto" keeps the work on the CPU (data already on the GPU stay there). Units: cells for metacells, matrix
# entries (cells x genes) for NMF, samples x genes for DESeq2. From the first H200 run against the 16-core CPU path
# (docs/benchmarks.md, "GPU (NVIDIA H200)", crossover): metacells 2,638 cells CPU 3.3x faster, 6,881 cells GPU 1.7x;
# NMF 2,638 x 2,000 CPU 1.7x, 6,881 x 2,000 GPU 1.35x; DESeq2 100 x 10,000 CPU 2.6x, 500 x 30,000 GPU 2.8x. The
# check script's crossover table re-measures them.
AUTO_GPU_MIN_WORK: dict[str, float] = {"metacells": 5_000, "nmf": 1e7, "deseq": 5e6}


def resolve_device(
    device: Device | None = None, data: Any = None, *, tool: str | None = None, work: float | None = None
) -> Literal["cpu", "gpu"]:
    """Turn ``"auto" | "cpu" | "gpu" | None`` into the device to use.

    ``None`` means :attr:`gpuc.settings.device`. ``"auto"`` picks the GPU when the input already lives there, else
    when cupy imports and sees a device and the problem is large enough for the GPU to win (``work`` at least
    :data:`AUTO_GPU_MIN_WORK` ``[tool]``, when both are given), else the CPU. ``"gpu"`` without a usable device raises
    a :class:`RuntimeError`.
    """
    if device is None:
        device = settings.device
    if device not in DEVICES:
        msg = f"device={device!r} is not valid; use one of {DEVICES}."
        raise ValueError(msg)
    if device == "cpu":
        return "cpu"
    if device == "gpu" or (data is not None and is_cupy_array(data)):
        ok, reason = gpu_status()
        if not ok:
            msg = f"device='gpu' was requested but no usable GPU was found: {reason}. Install {GPU_EXTRA_HINT} on a machine with an NVIDIA GPU, or pass device='cpu'."
            raise RuntimeError(msg)
        return "gpu"
    if tool is not None and work is not None and work < AUTO_GPU_MIN_WORK.get(tool, 0.0):
        return "cpu"
    return "gpu" if gpu_available() else "cpu"


def backend_of(x: Any) -> Backend:
    """The :class:`Backend` of the device where ``x`` lives (the GPU for cupy / cupyx arrays, else the CPU)."""
    return _backend_for("gpu" if is_cupy_array(x) else "cpu")


def get_backend(
    device: Device | None = None, data: Any = None, *, tool: str | None = None, work: float | None = None
) -> Backend:
    """Return the :class:`Backend` for ``device`` (see :func:`resolve_device`)."""
    return _backend_for(resolve_device(device, data, tool=tool, work=work))


@functools.cache
def _backend_for(name: str) -> Backend:
    if name == "cpu":
        return Backend("cpu", np, sp, scipy.special, scipy.sparse.linalg)
    purpose = "the GPU backend"
    return Backend(
        "gpu",
        optional_import("cupy", "gpu", purpose),
        optional_import("cupyx.scipy.sparse", "gpu", purpose),
        optional_import("cupyx.scipy.special", "gpu", purpose),
        optional_import("cupyx.scipy.sparse.linalg", "gpu", purpose),
    )


# --------------------------------------------------------------------------------------------------------------------
# kernel launches: device views made once per session, and counters for the stand-in's launch budgets
# --------------------------------------------------------------------------------------------------------------------
class LaunchStats:
    """Host-side work of :meth:`Backend.launch` in this process: Python-level kernel launches and device views made
    (one ``numba.cuda.as_cuda_array`` object per array argument outside a :meth:`Backend.kernel_session`, one per
    distinct array inside one). Tests read differences around a block of work (:func:`launch_stats`).
    """

    launches: int = 0
    views: int = 0


class LaunchCount:
    """Launches and views counted since a :func:`launch_stats` block began (read inside the block or after it)."""

    def __init__(self) -> None:
        self._start = (LaunchStats.launches, LaunchStats.views)
        self._end: tuple[int, int] | None = None

    def _now(self) -> tuple[int, int]:
        return self._end if self._end is not None else (LaunchStats.launches, LaunchStats.views)

    @property
    def launches(self) -> int:
        """Python-level kernel launches."""
        return self._now()[0] - self._start[0]

    @property
    def views(self) -> int:
        """Device views made for kernel arguments."""
        return self._now()[1] - self._start[1]


@contextlib.contextmanager
def launch_stats() -> Any:
    """Count :meth:`Backend.launch` calls and the device views they make inside the block (a :class:`LaunchCount`)."""
    out = LaunchCount()
    try:
        yield out
    finally:
        out._end = (LaunchStats.launches, LaunchStats.views)


def _make_view(make_view: Any, a: Any, *, owner: bool = True) -> Any:
    """The kernel argument for ``a``: a device view of a device array (counted), a scalar as it is; a host array is
    refused by the view maker (numba would copy it to the device and back at every launch, unseen). ``owner``: whether
    the view keeps ``a`` alive (outside a session; a session guards its views' arrays itself).
    """
    if make_view is None:
        return a
    if hasattr(a, "__cuda_array_interface__") or _is_device_object(a):
        LaunchStats.views += 1
        return make_view(a, owner=owner)
    if isinstance(a, np.ndarray) and a.ndim > 0:
        return make_view(a)  # raises: not a device array
    return a


def _is_device_object(a: Any) -> bool:
    """Arrays of a registered device namespace (the stand-in's), which have no ``__cuda_array_interface__``."""
    dense, sparse = _EXTRA_DEVICE_TYPES
    return bool(dense or sparse) and isinstance(a, dense + sparse)


@dataclass
class _KernelSession:
    """Device views (by array identity, each entry dropped when its array is garbage-collected), numba stream objects
    (by stream pointer) and configured kernels of one :meth:`Backend.kernel_session` block.

    A view in the session does not hold its array (numba's own ``as_cuda_array`` would, and the session would keep
    every array of a long fit alive): the entry holds a weak reference to the array and goes when the array does, so
    a view is only ever used for the live array it was made from.
    """

    views: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    streams: dict[int, Any] = field(default_factory=dict)
    configs: dict[tuple, Any] = field(default_factory=dict)

    def clear(self) -> None:
        """Drop the views; streams and launch configurations stay."""
        self.views.clear()

    def view(self, make_view: Any, a: Any) -> Any:
        key = id(a)
        hit = self.views.get(key)
        if hit is not None and hit[0]() is a:
            return hit[1]
        v = _make_view(make_view, a, owner=False)
        if v is not a:
            try:
                ref = weakref.ref(a, lambda _, views=self.views, key=key: views.pop(key, None))
            except TypeError:  # an array type without weak references: not cached
                return _make_view(make_view, a)
            self.views[key] = (ref, v)
        return v


_SESSION: contextvars.ContextVar[_KernelSession | None] = contextvars.ContextVar("gpuc_kernel_session", default=None)


# --------------------------------------------------------------------------------------------------------------------
# the backend
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    """Array namespace and device-specific helpers for one device.

    Attributes
    ----------
    name
        ``"cpu"`` or ``"gpu"``.
    xp
        ``numpy`` or ``cupy``.
    sparse
        ``scipy.sparse`` or ``cupyx.scipy.sparse``.
    special
        ``scipy.special`` or ``cupyx.scipy.special`` (gammaln, digamma, polygamma, ...).
    sparse_linalg
        ``scipy.sparse.linalg`` or ``cupyx.scipy.sparse.linalg`` (eigsh).
    launcher
        How :meth:`launch` runs a custom kernel on a device other than CuPy's (the stand-in device of
        :mod:`gpuc._testing.standin` runs it under numba-cuda's CUDA simulator); ``None`` for CuPy and the CPU.
    """

    name: str
    xp: ModuleType = field(repr=False)
    sparse: ModuleType = field(repr=False)
    special: ModuleType = field(repr=False)
    sparse_linalg: ModuleType = field(repr=False)
    launcher: Any = field(default=None, repr=False, compare=False)

    @property
    def is_gpu(self) -> bool:
        """Whether this backend runs on a CUDA device."""
        return self.name == "gpu"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # pickled by name (modules do not pickle): a Dask worker rebuilds its own backend for the same device
        return _backend_for, (self.name,)

    # ---- transfers -------------------------------------------------------------------------------------------------
    def asarray(self, x: Any, dtype: Any = None) -> Any:
        """Move ``x`` (dense or sparse, host or device) to this backend, converting dtype if given; no copy if already there."""
        if self.is_gpu:
            if is_sparse(x):
                if sp.issparse(x):
                    x = _cupyx_from_scipy(self.sparse, x)
                return x.astype(dtype) if dtype is not None and x.dtype != dtype else x
            return self.xp.asarray(x, dtype=dtype)
        x = to_host(x)
        if sp.issparse(x):
            return x.astype(dtype) if dtype is not None and x.dtype != dtype else x
        return np.asarray(x, dtype=dtype)

    def to_host(self, x: Any) -> Any:
        """Return ``x`` as numpy / scipy.sparse (see :func:`to_host`)."""
        return to_host(x)

    def free_memory(self) -> int | None:
        """Bytes this device can still allocate: the GPU's free memory plus CuPy's cached blocks, or the host's
        available memory (psutil when installed, else ``MemAvailable`` from ``/proc/meminfo``); ``None`` if unknown.
        """
        if self.is_gpu:
            free, _ = self.xp.cuda.runtime.memGetInfo()
            return int(free) + int(self.xp.get_default_memory_pool().free_bytes())
        return host_free_memory()

    def synchronize(self) -> None:
        """Wait for queued GPU work (for timing); no-op on the CPU."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    # ---- custom kernels --------------------------------------------------------------------------------------------
    def launch(self, kernel: Any, blocks: Any, threads: Any, *args: Any, shared_bytes: int = 0) -> None:
        """Launch the numba-cuda kernel ``kernel`` on ``blocks`` x ``threads`` with ``args`` (device arrays, scalars).

        The launch is queued on CuPy's current stream, so it is ordered with the CuPy operations around it and
        nothing waits for the device. ``shared_bytes`` sizes the kernel's dynamic shared memory. On the stand-in
        device the kernel runs under the CUDA simulator instead. Custom kernels are a GPU feature: the CPU path
        calls its numba CPU kernels directly.

        Each device-array argument is handed to numba as a device view (``numba.cuda.as_cuda_array``: a new Python
        object per array, tens of microseconds of host time). Inside :meth:`kernel_session` a view is made once per
        array and reused by every later launch in the block, as are the stream object and the launch configuration;
        :class:`LaunchStats` counts launches and views made.
        """
        if not self.is_gpu:
            msg = "Backend.launch runs GPU kernels; the CPU path calls its compiled CPU kernels directly."
            raise RuntimeError(msg)
        session = _SESSION.get()
        make_view = self._view_maker()
        if session is None:
            views = tuple(_make_view(make_view, a) for a in args)
        else:
            views = tuple(session.view(make_view, a) for a in args)
        LaunchStats.launches += 1
        if self.launcher is not None:
            self.launcher(kernel, blocks, threads, shared_bytes, views)
            return
        ptr = self.xp.cuda.get_current_stream().ptr  # CuPy's current stream (a session may see it change)
        key = (kernel, blocks, threads, shared_bytes, ptr)
        configured = None if session is None else session.configs.get(key)
        if configured is None:
            configured = kernel[blocks, threads, self._numba_stream(session, ptr), shared_bytes]
            if session is not None:
                session.configs[key] = configured
        configured(*views)

    def _view_maker(self) -> Any:
        """How a device array becomes a kernel argument: the launcher's ``view`` (the stand-in's: its host array) or
        numba's ``as_cuda_array`` (CuPy arrays, without numba's per-argument synchronisation on the stream each array
        exports: the launch is on that same stream, so ordering already holds).
        """
        if self.launcher is not None:
            view = getattr(self.launcher, "view", None)
            return None if view is None else lambda a, owner=True: view(a)
        from numba import cuda

        def view_of(a: Any, owner: bool = True) -> Any:
            if not hasattr(a, "__cuda_array_interface__"):
                return cuda.as_cuda_array(a)  # raises: not a device array
            return cuda.from_cuda_array_interface(a.__cuda_array_interface__, owner=a if owner else None, sync=False)

        return view_of

    def _numba_stream(self, session: _KernelSession | None, ptr: int) -> Any:
        from numba import cuda

        if session is not None and ptr in session.streams:
            return session.streams[ptr]
        stream = cuda.external_stream(ptr) if ptr else cuda.default_stream()
        if session is not None:
            session.streams[ptr] = stream
        return stream

    @contextlib.contextmanager
    def kernel_session(self) -> Any:
        """Within the block, :meth:`launch` makes each array's device view once and reuses it (and the stream object
        and launch configuration) in every later launch: an engine opens one session per fit or batch, so that its
        iterations make no new views (:class:`LaunchStats` counts them; the stand-in device's tests hold the engines
        to it). The session holds the arrays it has seen until the block ends or its ``clear()`` (an engine whose
        arrays are replaced, e.g. when runs leave a batch, clears it then). Nested blocks share the outer session.
        Yields the session.
        """
        outer = _SESSION.get()
        if outer is not None:
            yield outer
            return
        session = _KernelSession()
        token = _SESSION.set(session)
        try:
            yield session
        finally:
            _SESSION.reset(token)

    # ---- linear algebra --------------------------------------------------------------------------------------------
    def solve_batched(self, a: Any, b: Any) -> Any:
        """Solve the stacked systems ``a[..., :, :] @ x = b[..., :]`` (``b`` may also carry a trailing rhs axis)."""
        xp = self.xp
        if b.ndim == a.ndim - 1:
            return xp.linalg.solve(a, b[..., None])[..., 0]
        return xp.linalg.solve(a, b)

    # ---- nearest neighbours --------------------------------------------------------------------------------------
    def knn(
        self,
        x: Any,
        n_neighbors: int,
        *,
        method: Literal["auto", "exact", "ivf"] = "auto",
        queries: Any = None,
        n_lists: int | None = None,
        n_probe: int | None = None,
        block_size: int | None = None,
    ) -> tuple[Any, Any]:
        """Euclidean k nearest neighbours of each row of ``queries`` (default ``x``) among the rows of ``x``.

        Returns ``(distances, indices)``, each ``(n_queries, n_neighbors)``, sorted by distance, on this backend's
        device. When ``queries`` is ``x`` each point is its own first neighbour. ``method="exact"`` is brute force
        (FAISS ``IndexFlatL2``, or blocked matrix products on the GPU when FAISS-GPU is absent); ``"ivf"`` is FAISS
        ``IndexIVFFlat`` with ``n_lists`` (default ~4 sqrt(n)) cells and ``n_probe`` (default ~n_lists/8) probes;
        ``"auto"`` is exact up to 50,000 points, IVF above.
        """
        n = x.shape[0]
        if not 1 <= n_neighbors <= n:
            msg = f"n_neighbors={n_neighbors} must be between 1 and the number of points ({n})."
            raise ValueError(msg)
        if method not in ("auto", "exact", "ivf"):
            msg = f"method={method!r} is not valid; use 'auto', 'exact' or 'ivf'."
            raise ValueError(msg)
        if method == "auto":
            method = "exact" if n <= 50_000 else "ivf"
        faiss = _import_faiss(gpu=self.is_gpu, required=method == "ivf")
        if faiss is None:  # GPU without FAISS-GPU (or no FAISS at all): exact blocked products in xp
            return knn_blocked(self.xp, self.asarray(x), n_neighbors, queries=queries, block_size=block_size)
        xb = np.ascontiguousarray(to_host(x), dtype=np.float32)
        xq = xb if queries is None else np.ascontiguousarray(to_host(queries), dtype=np.float32)
        d = xb.shape[1]
        if method == "exact":
            index = faiss.IndexFlatL2(d)
        else:
            n_lists = n_lists or max(1, min(int(4 * math.sqrt(n)), n // 39))
            quantizer = faiss.IndexFlatL2(d)
            index = faiss.IndexIVFFlat(quantizer, d, n_lists)
            index.train(xb)
            index.nprobe = n_probe or max(1, n_lists // 8)
        if self.is_gpu:
            index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
        index.add(xb)
        if method == "exact" and not self.is_gpu:
            dist2, idx = _flat_search_fixed_blocks(faiss, index, xq, n_neighbors)
        else:
            dist2, idx = index.search(xq, n_neighbors)
        dist = np.sqrt(np.maximum(dist2, 0.0))
        return self.asarray(dist), self.asarray(idx.astype(np.int64))


# --------------------------------------------------------------------------------------------------------------------
# helpers written once for numpy and cupy
# --------------------------------------------------------------------------------------------------------------------
def _flat_search_fixed_blocks(faiss: ModuleType, index: Any, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """FAISS exact search whose result does not depend on the thread count.

    ``IndexFlatL2.search`` computes distances block by block with SGEMM (blocks of
    ``faiss.cvar.distance_compute_blas_query_bs`` queries), and a multi-threaded SGEMM partitions its output by the
    thread count, computing some entries with edge micro-kernels that round differently: the neighbours of a cell then
    changed with ``n_jobs``. Here every query block is searched by one call on one thread (OpenMP and BLAS), so each
    block runs exactly the SGEMMs of a single-threaded search of all queries; the blocks run concurrently on the
    threads of the enclosing :func:`gpuc._utils.cpu_threads` block (FAISS releases the GIL). A last block too small
    for FAISS's SGEMM path (``distance_compute_blas_threshold``) is merged into the one before, as a single call
    would treat it.
    """
    from concurrent.futures import ThreadPoolExecutor

    nq = xq.shape[0]
    block = int(getattr(faiss.cvar, "distance_compute_blas_query_bs", 4096))
    threshold = int(getattr(faiss.cvar, "distance_compute_blas_threshold", 20))
    starts = list(range(0, nq, block))
    if len(starts) > 1 and nq - starts[-1] <= threshold:
        starts.pop()
    spans = list(zip(starts, [*starts[1:], nq], strict=True))
    from gpuc._utils import _FAISS_LIMITS, one_thread_pools

    # through the shared limits: a limit saved and restored here would restore a concurrent call's limit
    with (
        _FAISS_LIMITS.hold(faiss=1),
        one_thread_pools("blas", "openmp"),
        ThreadPoolExecutor(max_workers=max(1, min(current_n_jobs(), len(spans)))) as pool,
    ):
        parts = list(pool.map(lambda span: _search_one_thread(faiss, index, xq[span[0] : span[1]], k), spans))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _search_one_thread(faiss: ModuleType, index: Any, xq: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``index.search`` on one OpenMP thread: the thread count is a per-thread OpenMP setting, so it is set in the
    pool thread that searches (a new thread starts from ``OMP_NUM_THREADS`` or the core count).
    """
    faiss.omp_set_num_threads(1)
    return index.search(xq, k)


@contextlib.contextmanager
def _nothing() -> Any:
    yield


def knn_blocked(
    xp: ModuleType, x: Any, n_neighbors: int, *, queries: Any = None, block_size: int | None = None
) -> tuple[Any, Any]:
    """Exact Euclidean kNN by blocked matrix products, in any ``xp``, without sorting whole distance rows.

    Used on the GPU (CuPy; FAISS-GPU is not a dependency). For ``q`` queries among ``n`` points of dimension ``d``
    and ``k = n_neighbors``, per block of ``b`` queries:

    * distances ``||q||^2 - 2 q.x + ||x||^2``: one ``(b, d) x (d, n)`` product, ``2 b n d`` FLOP (``4e12`` for
      200,000 cells x 50 PCs in all: well under a second on an H200), and ``b n`` values written;
    * selection without a full sort (``cupy.argpartition`` sorts whole rows, ``n log n`` per query): the columns are
      cut into ``n / s`` segments of ``s ~ sqrt(n / k)`` points; one pass takes each segment's minimum (``b n``
      reads); the ``k`` segments with the smallest minima, found by a stable sort of ``b n / s`` minima, hold the
      ``k`` nearest points (a point outside them has ``k`` segment minima, each a distinct point, at or before it in
      (distance, index) order); their ``k s`` candidate columns, in column order, are stable-sorted (``b k s`` keys)
      and the first ``k`` kept. Sort work per query is ``n / s + k s ~ 2 sqrt(n k)`` keys instead of ``n`` (about
      5,000 instead of 200,000 for 200,000 cells, k = 30).

    The result is exactly a stable sort of each row's distances cut at ``k`` (ties go to the lower index). A query
    that is a point of ``x`` (``queries=None``) is its own first neighbour, at distance 0. Memory per block is ``b n``
    distances; ``block_size=None`` takes ~256 MB blocks.
    """
    x = xp.asarray(x)
    q = x if queries is None else xp.asarray(queries)
    n, k = x.shape[0], n_neighbors
    s = max(1, round(math.sqrt(n / k)))  # segment width
    nseg = -(-n // s)
    x_sq = (x * x).sum(axis=1)
    pad = nseg * s - n
    if pad:  # padded columns: zero points at infinite squared norm, so their distances are +inf
        x = xp.concatenate([x, xp.zeros((pad, x.shape[1]), dtype=x.dtype)])
        x_sq = xp.concatenate([x_sq, xp.full(pad, xp.inf, dtype=x_sq.dtype)])
    if block_size is None:
        block_size = max(1, (1 << 28) // (x.dtype.itemsize * nseg * s))
    select = k < nseg
    offsets = xp.arange(s)
    all_cols = None if select else xp.arange(nseg * s)
    out_d = xp.empty((q.shape[0], k), dtype=x.dtype)
    out_i = xp.empty((q.shape[0], k), dtype=xp.int64)
    for start in range(0, q.shape[0], block_size):
        qb = q[start : start + block_size]
        b = qb.shape[0]
        d2 = (qb * qb).sum(axis=1)[:, None] - 2.0 * (qb @ x.T) + x_sq[None, :]
        if queries is None:  # a point is its own nearest neighbour, exactly (avoid rounding ties)
            rows = xp.arange(b)
            d2[rows, start + rows] = -1.0
        if select:
            seg_min = d2.reshape(b, nseg, s).min(axis=2)
            top = xp.sort(xp.argsort(seg_min, axis=1, kind="stable")[:, :k], axis=1)  # k segments, column order
            cols = (top[:, :, None] * s + offsets[None, None, :]).reshape(b, k * s)
            cand = xp.take_along_axis(d2, cols, axis=1)
        else:
            cols = xp.broadcast_to(all_cols, d2.shape)
            cand = d2
        order = xp.argsort(cand, axis=1, kind="stable")[:, :k]
        out_i[start : start + b] = xp.take_along_axis(cols, order, axis=1)
        out_d[start : start + b] = xp.sqrt(xp.maximum(xp.take_along_axis(cand, order, axis=1), 0.0))
    return out_d, out_i


def _cupyx_from_scipy(cpsparse: ModuleType, x: Any) -> Any:
    if x.format not in ("csr", "csc", "coo"):
        x = x.tocsr()
    fmt = {"csr": cpsparse.csr_matrix, "csc": cpsparse.csc_matrix, "coo": cpsparse.coo_matrix}[x.format]
    if isinstance(x, sp.sparray):  # cupyx takes the matrix classes
        x = {"csr": sp.csr_matrix, "csc": sp.csc_matrix, "coo": sp.coo_matrix}[x.format](x)
    return fmt(x)


def _import_faiss(*, gpu: bool, required: bool) -> ModuleType | None:
    """FAISS for this device: faiss-cpu on the CPU; on the GPU, only a build with GPU support (else ``None``).

    gpuc's GPU extras do not install FAISS-GPU (the GPU path needs CuPy only): without it, exact kNN on the GPU runs
    as blocked CuPy products and approximate (IVF) kNN is unavailable there.
    """
    try:
        faiss = importlib.import_module("faiss")
    except ImportError as err:
        if required:
            msg = f"faiss could not be imported ({err}); it comes with gpuc (faiss-cpu): reinstall gpuc."
            raise ImportError(msg) from err
        return None
    if gpu and not hasattr(faiss, "StandardGpuResources"):
        if required:
            msg = "approximate (IVF) kNN on the GPU needs a FAISS build with GPU support, which gpuc does not install; use method='exact'."
            raise ImportError(msg)
        return None
    return faiss


def host_free_memory() -> int | None:
    """Bytes of host memory available to new allocations (psutil, else ``/proc/meminfo``), ``None`` if unknown."""
    try:
        import psutil
    except ImportError:
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    return int(psutil.virtual_memory().available)


def to_host(x: Any) -> Any:
    """Return ``x`` in host memory: cupy -> numpy, cupyx sparse -> scipy CSR/CSC/COO; anything else unchanged."""
    if is_cupy_array(x):
        return x.get()
    return x
