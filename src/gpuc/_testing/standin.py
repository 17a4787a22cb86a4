"""A stand-in GPU: device namespaces whose arrays live "elsewhere", for running gpuc's GPU code path without a GPU.

:class:`DeviceArray` wraps a numpy array and :class:`DeviceSparse` a scipy sparse matrix. They behave like CuPy's
``ndarray`` and cupyx's sparse matrices where it matters for finding mistakes:

* implicit conversion to the host fails: ``numpy.asarray(x)``, ``np.ascontiguousarray(x)``, ``float(x)`` of a
  non-scalar, passing ``x`` to scipy or numba all raise (``__array__`` raises :class:`TypeError`, as CuPy's does);
  ``x.get()`` is the one explicit way back, as in CuPy;
* a host array mixed into device work fails: ``device + numpy_array``, ``xp.exp(numpy_array)``, ``dev[...] =
  numpy_array``, ``sparse @ numpy_array`` raise, as CuPy refuses them. Uploads are explicit: ``xp.asarray`` /
  ``xp.array`` (and the sparse constructors from scipy matrices, as cupyx allows); numpy index arrays are accepted
  in indexing, as CuPy uploads them;
* only what CuPy offers is offered: ``xp.<name>``, ``xp.linalg.<name>``, ``sparse.<name>``, ``special.<name>`` and
  ``ndarray.<method>`` are limited to the public names of CuPy / cupyx (:mod:`._cupy_names`), and a numpy function
  called on a device array (``np.foo(x)``) dispatches through ``__array_function__`` only when CuPy has ``foo``;
* reductions return 0-d device arrays (CuPy's), not host scalars; ``int()``/``float()``/``bool()`` of one are the
  explicit synchronising reads CuPy allows.

Numerics are numpy's and scipy's, so a stand-in run gives the CPU results up to the order of floating-point
operations. What it cannot show: CuPy-specific numerical differences, kernels' speed, device memory limits.

Use :func:`standin_backend` for a :class:`gpuc._backend.Backend` named ``"gpu"`` over these namespaces, and
:func:`use_standin` to make ``device="gpu"`` / ``"auto"`` (and device-resident input) resolve to it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import math
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg
import scipy.special
from anndata import compat as _anndata_compat
from numpy.lib.mixins import NDArrayOperatorsMixin

from gpuc._testing import _cupy_names as names

# AnnData accepts cupy / cupyx arrays in X, layers and obsm. Without CuPy its type checks test against placeholder
# classes in anndata.compat: the stand-in classes derive from them so that an AnnData holds them as it holds CuPy
# data (with CuPy installed the placeholders are CuPy's own classes and the stand-in cannot be put in an AnnData).
# anndata 0.13's placeholders name their module "cupy" too, so the test is whether CuPy itself is importable.
ANNDATA_ACCEPTS = importlib.util.find_spec("cupy") is None
_DenseBase: type = _anndata_compat.CupyArray if ANNDATA_ACCEPTS else object
_SparseBase: type = _anndata_compat.CupySparseMatrix if ANNDATA_ACCEPTS else object

UPLOADS = frozenset({"asarray", "array", "asanyarray"})  # the functions that take host data (explicit uploads)


class Transfers:
    """Bytes moved between host and the stand-in device (explicit uploads and ``.get()`` downloads)."""

    to_device: int = 0
    to_host: int = 0

    @classmethod
    def reset(cls) -> None:
        """Zero both counters."""
        cls.to_device = cls.to_host = 0


class Counts:
    """Device operations and synchronising reads on the stand-in device, for launch budgets in CPU tests.

    An *operation* is what CuPy turns into at least one kernel launch (or a copy): a ufunc, an ``xp`` / ``sparse`` /
    ``linalg`` / ``special`` call, an array or sparse method, an advanced-index read, any write into an array, a
    custom kernel launched through :meth:`gpuc._backend.Backend.launch`. Views (basic slicing, ``reshape``, ``.T``,
    ``transpose``...) and allocations without initialisation (``empty``) are not operations, as in CuPy.

    A *read* is what makes the host wait for the device: ``int()`` / ``float()`` / ``bool()`` / ``complex()`` of a
    device array, ``.get()``, ``.item()``, ``.tolist()``, ``xp.asnumpy``.

    ``by_name`` keeps the count of each operation's name (``"xp.dot"``, ``"ufunc.multiply"``, ``"kernel.sweep"``...)
    so that a budget test that fails says where the launches come from. Use :func:`counting`.
    """

    ops: ClassVar[int] = 0
    reads: ClassVar[int] = 0
    by_name: ClassVar[collections.Counter[str]] = collections.Counter()

    @classmethod
    def reset(cls) -> None:
        """Zero the counters."""
        cls.ops = cls.reads = 0
        cls.by_name = collections.Counter()

    @classmethod
    def op(cls, name: str) -> None:
        """Count one device operation called ``name``."""
        cls.ops += 1
        cls.by_name[name] += 1

    @classmethod
    def read(cls, name: str) -> None:
        """Count one synchronising read called ``name``."""
        cls.reads += 1
        cls.by_name["read:" + name] += 1


@dataclass
class CountSnapshot:
    """Operations and reads counted inside one :func:`counting` block (filled in when the block ends)."""

    ops: int = 0
    reads: int = 0
    by_name: collections.Counter[str] = field(default_factory=collections.Counter)

    def top(self, n: int = 12) -> str:
        """The ``n`` most frequent operation names with their counts, for assertion messages."""
        return ", ".join(f"{k}: {v}" for k, v in self.by_name.most_common(n))


@contextlib.contextmanager
def counting() -> Iterator[CountSnapshot]:
    """Count stand-in device operations and synchronising reads inside the block.

    Examples
    --------
    >>> with counting() as c:  # doctest: +SKIP
    ...     fit(...)
    >>> c.ops, c.reads  # doctest: +SKIP
    """
    saved = Counts.ops, Counts.reads, Counts.by_name
    Counts.reset()
    snap = CountSnapshot()
    try:
        yield snap
    finally:
        snap.ops, snap.reads, snap.by_name = Counts.ops, Counts.reads, Counts.by_name
        Counts.ops, Counts.reads = saved[0] + snap.ops, saved[1] + snap.reads
        Counts.by_name = saved[2] + snap.by_name


class Memory:
    """Bytes held by the live arrays of the stand-in device, as CuPy's memory pool counts its used bytes.

    While :func:`device_memory` is active, every buffer behind a :class:`DeviceArray` (a view counts its base once)
    and the arrays of a :class:`DeviceSparse` (data, indices, index pointers) are counted from the moment they are
    wrapped until they are freed, and the peak is kept. Temporaries that numpy or scipy allocate and free inside one
    call are not seen (CuPy's kernels use few such; cuSPARSE's work buffers are similar), so a measured peak is a
    lower bound of what the same calls hold on a GPU, up to those.
    """

    active: ClassVar[bool] = False
    current: ClassVar[int] = 0
    peak: ClassVar[int] = 0
    _live: ClassVar[dict[int, int]] = {}

    @classmethod
    def track(cls, a: Any) -> None:
        """Count the buffer behind the numpy array ``a`` (once, until it is freed)."""
        if not cls.active or not isinstance(a, np.ndarray):
            return
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        key = id(root)
        if key in cls._live:
            return
        size = int(root.nbytes)
        cls._live[key] = size
        cls.current += size
        cls.peak = max(cls.peak, cls.current)
        weakref.finalize(root, cls._release, key)

    @classmethod
    def _release(cls, key: int) -> None:
        cls.current -= cls._live.pop(key, 0)


@dataclass
class MemorySnapshot:
    """Device bytes measured inside one :func:`device_memory` block (``peak`` filled in when the block ends)."""

    peak: int = 0
    at_exit: int = 0


@contextlib.contextmanager
def device_memory() -> Iterator[MemorySnapshot]:
    """Measure the peak bytes held by stand-in device arrays created inside the block (see :class:`Memory`).

    Arrays created before the block are not counted: upload the inputs inside it.
    """
    Memory.active, Memory.current, Memory.peak = True, 0, 0
    Memory._live.clear()
    snap = MemorySnapshot()
    try:
        yield snap
    finally:
        snap.peak, snap.at_exit = Memory.peak, Memory.current
        Memory.active = False
        Memory._live.clear()


# CuPy functions / methods that return views or uninitialised memory: no kernel launch, not counted as operations
VIEW_FUNCTIONS = frozenset(
    {
        "reshape", "transpose", "swapaxes", "moveaxis", "expand_dims", "squeeze", "broadcast_to", "view",
        "empty", "empty_like", "atleast_1d", "atleast_2d", "atleast_3d", "shape", "ndim", "size", "result_type",
        "can_cast", "dtype", "finfo", "iinfo", "isscalar", "get_array_module", "issparse", "isspmatrix",
    }
)  # fmt: skip
READ_METHODS = frozenset({"get", "item", "tolist", "asnumpy"})


def _basic_index(key: Any) -> bool:
    """Whether ``key`` is basic indexing (ints, slices, None, Ellipsis): a view in CuPy, no launch."""
    parts = key if isinstance(key, tuple) else (key,)
    return all(
        k is None
        or k is Ellipsis
        or isinstance(k, slice)
        or (isinstance(k, int | np.integer) and not isinstance(k, bool))
        for k in parts
    )


def _nbytes(x: Any) -> int:
    if sp.issparse(x):
        return int(
            sum(getattr(x, a).nbytes for a in ("data", "indices", "indptr", "row", "col", "offsets") if hasattr(x, a))
        )
    return int(getattr(x, "nbytes", 0))


def _count_upload(x: Any) -> None:
    if isinstance(x, list | tuple):
        for v in x:
            _count_upload(v)
    elif isinstance(x, np.ndarray) or sp.issparse(x):
        Transfers.to_device += _nbytes(x)


class HostArrayError(TypeError):
    """A host array reached device code, or device data was converted to the host implicitly."""


# --------------------------------------------------------------------------------------------------------------------
# unwrapping arguments and wrapping results
# --------------------------------------------------------------------------------------------------------------------
def _unwrap(x: Any, where: str, *, host_ok: bool = False) -> Any:
    """Device objects -> their numpy / scipy payloads, recursively in lists, tuples and dicts.

    A host numpy array (not 0-d) or scipy sparse matrix raises unless ``host_ok`` (explicit uploads).
    """
    if isinstance(x, DeviceArray | DeviceSparse):
        return x._a
    if isinstance(x, np.ndarray) and not isinstance(x, np.generic):
        if x.ndim == 0 or host_ok:
            return x
        msg = f"stand-in GPU: a host numpy array {x.shape} was passed to {where}; CuPy refuses host arrays there (upload it with xp.asarray)."
        raise HostArrayError(msg)
    if sp.issparse(x):
        if host_ok:
            return x
        msg = f"stand-in GPU: a host scipy sparse matrix was passed to {where}; upload it first."
        raise HostArrayError(msg)
    if isinstance(x, list | tuple):
        out = [_unwrap(v, where, host_ok=host_ok) for v in x]
        return type(x)(out) if isinstance(x, tuple) and not hasattr(x, "_fields") else out
    if isinstance(x, dict):
        return {k: _unwrap(v, where, host_ok=host_ok) for k, v in x.items()}
    return x


def _wrap(x: Any) -> Any:
    """Numpy / scipy results -> device objects (numpy scalars become 0-d device arrays, as CuPy returns)."""
    if isinstance(x, np.matrix):
        return DeviceArray(np.asarray(x))
    if isinstance(x, np.ndarray):
        return DeviceArray(x)
    if isinstance(x, np.generic):
        return DeviceArray(np.asarray(x))
    if sp.issparse(x):
        return DeviceSparse(x)
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_wrap(v) for v in x)
    if isinstance(x, tuple):  # named tuples (e.g. slogdet, eigh results)
        return type(x)(*(_wrap(v) for v in x))
    if isinstance(x, list):
        return [_wrap(v) for v in x]
    return x


def _call(fn: Any, where: str, args: tuple, kwargs: dict, *, host_ok: bool = False) -> Any:
    short = where.rsplit(".", 1)[-1]
    if short in READ_METHODS:
        Counts.read(where)
    elif short not in VIEW_FUNCTIONS:
        Counts.op(where)
    out_obj = kwargs.get("out")
    a = _unwrap(args, where, host_ok=host_ok)
    k = _unwrap(kwargs, where, host_ok=host_ok)
    res = fn(*a, **k)
    if out_obj is not None and isinstance(out_obj, DeviceArray) and res is out_obj._a:
        return out_obj
    return _wrap(res)


def _no_host(what: str) -> HostArrayError:
    return HostArrayError(
        f"stand-in GPU: implicit conversion of a device array to the host ({what}); CuPy raises here. "
        "Use .get() (or gpuc._backend.to_host) where a host copy is meant."
    )


# --------------------------------------------------------------------------------------------------------------------
# dense device array
# --------------------------------------------------------------------------------------------------------------------
class DeviceArray(NDArrayOperatorsMixin, _DenseBase):
    """A numpy array on the stand-in device (see the module docstring for what it refuses)."""

    # weak references: a kernel session keys its views by them (a base class without slots already allows them)
    __slots__ = ("_a",) if hasattr(_DenseBase, "__weakref__") else ("_a", "__weakref__")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        if Memory.active:
            Memory.track(a)

    # ---- refusals of implicit host conversion
    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise _no_host("__array__")

    def __index__(self) -> int:  # CuPy arrays have no __index__
        raise _no_host("__index__")

    def __int__(self) -> int:
        Counts.read("int")
        return int(self._a)

    def __float__(self) -> float:
        Counts.read("float")
        return float(self._a)

    def __complex__(self) -> complex:
        Counts.read("complex")
        return complex(self._a)

    def __bool__(self) -> bool:
        Counts.read("bool")
        return bool(self._a)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[Any]:
        if self._a.ndim == 0:
            msg = "iteration over a 0-d array"
            raise TypeError(msg)
        return (self[i] for i in range(self._a.shape[0]))

    def __repr__(self) -> str:
        return f"DeviceArray({self._a!r})"

    # ---- the explicit way back (CuPy's .get())
    def get(self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True) -> np.ndarray:
        """A host copy (numpy), as ``cupy.ndarray.get``."""
        Counts.read("get")
        Transfers.to_host += self._a.nbytes
        return np.array(self._a, order=order)

    # ---- numpy protocols: delegate to numpy for what CuPy has, refuse host arrays
    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if any(isinstance(v, DeviceSparse) for v in inputs):
            return NotImplemented
        name = ufunc.__name__
        if name not in names.CUPY and name not in names.CUPYX_SPECIAL:
            return NotImplemented
        Counts.op(f"ufunc.{name}" if method == "__call__" else f"ufunc.{name}.{method}")
        if "out" in kwargs:
            outs = kwargs["out"]
            if not all(isinstance(o, DeviceArray) for o in outs):
                msg = f"stand-in GPU: out= of {name} must be a device array."
                raise HostArrayError(msg)
            rest = _unwrap({k: v for k, v in kwargs.items() if k != "out"}, name)
            getattr(ufunc, method)(*_unwrap(inputs, f"numpy.{name}"), out=tuple(o._a for o in outs), **rest)
            return outs[0] if len(outs) == 1 else outs
        return _wrap(getattr(ufunc, method)(*_unwrap(inputs, f"numpy.{name}"), **_unwrap(kwargs, name)))

    def __array_function__(self, func: Any, types_: Any, args: tuple, kwargs: dict) -> Any:
        mod = func.__module__ or ""
        table = names.CUPY_LINALG if mod.endswith("linalg") else names.CUPY
        if func.__name__ not in table:
            return NotImplemented
        return _call(func, f"numpy.{func.__name__}", args, kwargs)

    # ---- attributes and methods
    @property
    def shape(self) -> tuple[int, ...]:
        return self._a.shape

    @property
    def dtype(self) -> np.dtype:
        return self._a.dtype

    @property
    def ndim(self) -> int:
        return self._a.ndim

    @property
    def size(self) -> int:
        return self._a.size

    @property
    def nbytes(self) -> int:
        return self._a.nbytes

    @property
    def strides(self) -> tuple[int, ...]:
        return self._a.strides

    @property
    def flags(self) -> Any:
        return self._a.flags

    @property
    def T(self) -> DeviceArray:
        return DeviceArray(self._a.T)

    @property
    def real(self) -> DeviceArray:
        return DeviceArray(self._a.real)

    @property
    def imag(self) -> DeviceArray:
        return DeviceArray(self._a.imag)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in names.NDARRAY:
            msg = f"stand-in GPU: cupy.ndarray has no attribute {name!r}"
            raise AttributeError(msg)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _wrap(attr)

        @functools.wraps(attr)
        def method(*args: Any, **kwargs: Any) -> Any:
            return _call(attr, f"ndarray.{name}", args, kwargs)

        return method

    def __getitem__(self, key: Any) -> Any:
        if not _basic_index(key):
            Counts.op("getitem")
        return _wrap(self._a[_unwrap(key, "indexing", host_ok=True)])

    def __setitem__(self, key: Any, value: Any) -> None:
        Counts.op("setitem")
        self._a[_unwrap(key, "indexing", host_ok=True)] = _unwrap(value, "an assignment into a device array")


# --------------------------------------------------------------------------------------------------------------------
# sparse device matrix
# --------------------------------------------------------------------------------------------------------------------
class DeviceSparse(_SparseBase):
    """A scipy sparse matrix on the stand-in device (cupyx's sparse matrices: CSR, CSC, COO, DIA)."""

    __slots__ = ("_a", "_arrays") if hasattr(_SparseBase, "__weakref__") else ("_a", "_arrays", "__weakref__")
    __array_ufunc__ = None  # numpy defers binary operators to this class (cupyx sparse's __array_priority__)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, a: Any) -> None:
        if isinstance(a, sp.sparray):  # cupyx holds the matrix classes
            a = {"csr": sp.csr_matrix, "csc": sp.csc_matrix, "coo": sp.coo_matrix, "dia": sp.dia_matrix}.get(
                a.format, sp.csr_matrix
            )(a)
        self._a = a
        self._arrays = {}  # the device arrays handed out for data / indices / indptr..., one object per array
        if Memory.active:
            for name in ("data", "indices", "indptr", "row", "col"):
                Memory.track(getattr(a, name, None))

    def __setattr__(self, name: str, value: Any) -> None:
        # cupyx lets code assign a matrix's data / indices / indptr (e.g. ``m.data *= x`` writes back): pass it through
        if name in ("_a", "_arrays"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._a, name, _unwrap(value, f"sparse.{name} ="))

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise _no_host("__array__ of a sparse matrix")

    def __repr__(self) -> str:
        return f"DeviceSparse({self._a!r})"

    def __len__(self) -> int:
        msg = "sparse matrix length is ambiguous"
        raise TypeError(msg)

    def __bool__(self) -> bool:
        Counts.read("sparse.bool")
        return bool(self._a)

    def get(self, stream: Any = None) -> Any:
        """A host copy (scipy.sparse), as cupyx's ``.get()``."""
        Counts.read("sparse.get")
        Transfers.to_host += _nbytes(self._a)
        return self._a.copy()

    @property
    def shape(self) -> tuple[int, int]:
        return self._a.shape

    @property
    def dtype(self) -> np.dtype:
        return self._a.dtype

    @property
    def nnz(self) -> int:
        return self._a.nnz

    @property
    def ndim(self) -> int:
        return 2

    @property
    def format(self) -> str:
        return self._a.format

    @property
    def T(self) -> DeviceSparse:
        return DeviceSparse(self._a.T)

    @property
    def has_canonical_format(self) -> bool:
        return self._a.has_canonical_format

    @property
    def has_sorted_indices(self) -> bool:
        return self._a.has_sorted_indices

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if isinstance(attr, np.ndarray):
            # data / indices / indptr / row / col: device views of the same memory, the same object at every access
            # as cupyx's attributes are (a kernel session makes one kernel view per array object)
            held = self._arrays.get(name)
            if held is None or held._a is not attr:
                held = self._arrays[name] = DeviceArray(attr)
            return held
        if not callable(attr):
            return _wrap(attr)

        @functools.wraps(attr)
        def method(*args: Any, **kwargs: Any) -> Any:
            return _call(attr, f"sparse.{name}", args, kwargs)

        return method

    def __getitem__(self, key: Any) -> Any:
        Counts.op("sparse.getitem")
        return _wrap(self._a[_unwrap(key, "sparse indexing", host_ok=True)])

    def _binop(self, op: str, other: Any) -> Any:
        if isinstance(other, np.ndarray) and other.ndim > 0:
            raise _unwrap_error(op)
        Counts.op(f"sparse.{op.strip('_')}")
        return _wrap(getattr(self._a, op)(_unwrap(other, f"sparse {op}")))

    def __matmul__(self, other: Any) -> Any:
        return self._binop("__matmul__", other)

    def __rmatmul__(self, other: Any) -> Any:
        return self._binop("__rmatmul__", other)

    def __add__(self, other: Any) -> Any:
        return self._binop("__add__", other)

    def __radd__(self, other: Any) -> Any:
        return self._binop("__radd__", other)

    def __sub__(self, other: Any) -> Any:
        return self._binop("__sub__", other)

    def __rsub__(self, other: Any) -> Any:
        return self._binop("__rsub__", other)

    def __mul__(self, other: Any) -> Any:
        if not np.isscalar(other) and not (isinstance(other, DeviceArray) and other.ndim == 0):
            msg = "stand-in GPU: use @ or .multiply() with sparse matrices (gpuc never relies on spmatrix '*')."
            raise TypeError(msg)
        return self._binop("__mul__", other)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Any:
        return self._binop("__truediv__", other)

    def __neg__(self) -> DeviceSparse:
        Counts.op("sparse.neg")
        return DeviceSparse(-self._a)

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self._binop("__eq__", other)

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self._binop("__ne__", other)


def _unwrap_error(op: str) -> HostArrayError:
    return HostArrayError(f"stand-in GPU: a host numpy array was combined with a device sparse matrix ({op}).")


# --------------------------------------------------------------------------------------------------------------------
# namespaces
# --------------------------------------------------------------------------------------------------------------------
class _Namespace(types.ModuleType):
    """A module-like namespace exposing ``allowed`` names of ``source`` with device wrapping."""

    def __init__(self, name: str, source: Any, allowed: frozenset[str], **extra: Any) -> None:
        super().__init__(name)
        self._source = source
        self._allowed = allowed
        for k, v in extra.items():
            setattr(self, k, v)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name not in self._allowed:
            msg = f"stand-in GPU: module {self.__name__!r} (as CuPy's) has no attribute {name!r}"
            raise AttributeError(msg)
        attr = getattr(self._source, name)
        if isinstance(attr, type) or not callable(attr):  # dtypes, classes, constants
            return attr
        where = f"{self.__name__}.{name}"
        host_ok = name in UPLOADS and self._source is np

        @functools.wraps(attr)
        def fn(*args: Any, **kwargs: Any) -> Any:
            if host_ok and args:
                _count_upload(args[0])
            return _call(attr, where, args, kwargs, host_ok=host_ok)

        setattr(self, name, fn)
        return fn


def _sparse_constructor(cls: Any, name: str) -> Any:
    def make(arg1: Any, shape: Any = None, dtype: Any = None, copy: bool = False) -> DeviceSparse:
        if isinstance(arg1, DeviceSparse | sp.spmatrix | sp.sparray):
            payload = arg1._a if isinstance(arg1, DeviceSparse) else arg1  # cupyx uploads scipy matrices
            if not isinstance(arg1, DeviceSparse):
                _count_upload(arg1)
        else:
            payload = _unwrap(arg1, f"sparse.{name}")
        return DeviceSparse(cls(payload, shape=shape, dtype=dtype, copy=copy))

    make.__name__ = name
    return make


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:
        return 1

    @staticmethod
    def memGetInfo() -> tuple[int, int]:
        from gpuc._backend import host_free_memory

        free = host_free_memory() or 0
        return free, free


class _Stream:
    def synchronize(self) -> None:
        return None


class _Pool:
    def free_bytes(self) -> int:
        return 0

    def used_bytes(self) -> int:
        return 0

    def free_all_blocks(self) -> None:
        return None


_cuda = types.SimpleNamespace(runtime=_Runtime(), get_current_stream=_Stream, Stream=_Stream)

linalg = _Namespace("standin.linalg", np.linalg, names.CUPY_LINALG)
random = _Namespace("standin.random", np.random, names.CUPY_RANDOM)
xp = _Namespace(
    "standin",
    np,
    names.CUPY - {"linalg", "random", "fft", "cuda", "ndarray", "get_default_memory_pool"},
    linalg=linalg,
    random=random,
    ndarray=DeviceArray,
    cuda=_cuda,
    get_default_memory_pool=_Pool,
    asnumpy=lambda a, *args, **kw: a.get() if isinstance(a, DeviceArray | DeviceSparse) else np.asarray(a),
)
sparse_linalg = _Namespace("standin.sparse.linalg", scipy.sparse.linalg, names.CUPYX_SPARSE_LINALG)
sparse = _Namespace(
    "standin.sparse",
    sp,
    names.CUPYX_SPARSE - {"csr_matrix", "csc_matrix", "coo_matrix", "dia_matrix", "issparse", "isspmatrix", "spmatrix"},
    csr_matrix=_sparse_constructor(sp.csr_matrix, "csr_matrix"),
    csc_matrix=_sparse_constructor(sp.csc_matrix, "csc_matrix"),
    coo_matrix=_sparse_constructor(sp.coo_matrix, "coo_matrix"),
    dia_matrix=_sparse_constructor(sp.dia_matrix, "dia_matrix"),
    issparse=lambda x: isinstance(x, DeviceSparse),
    isspmatrix=lambda x: isinstance(x, DeviceSparse),
    spmatrix=DeviceSparse,
    linalg=sparse_linalg,
)
special = _Namespace("standin.special", scipy.special, names.CUPYX_SPECIAL)


# --------------------------------------------------------------------------------------------------------------------
# a backend over the stand-in, and switching gpuc to it
# --------------------------------------------------------------------------------------------------------------------
def simulator_status() -> tuple[bool, str]:
    """Whether numba-cuda's CUDA simulator is active in this process (``NUMBA_ENABLE_CUDASIM=1`` before numba's
    import), so that custom kernels can run on the stand-in device; and why not.
    """
    try:
        import numba
        from numba import cuda  # noqa: F401
    except ImportError as err:
        return False, f"numba-cuda is not installed ({err}); pip install numba-cuda"
    if not numba.config.ENABLE_CUDASIM:
        return False, "numba's CUDA simulator is off: set NUMBA_ENABLE_CUDASIM=1 before numba is imported"
    return True, "numba-cuda CUDA simulator"


@dataclass
class LaunchRecord:
    """One kernel launch on the stand-in device: the kernel's name, its grid, and the numba types of its arguments
    (the signature numba compiles on a GPU for the same call: arrays by dtype, dimensions and layout, Python ints as
    int64, floats as float64, bools as boolean).
    """

    name: str
    kernel_id: str  # module.name of the kernel's Python function
    blocks: Any
    threads: Any
    shared_bytes: int
    signature: tuple

    @property
    def n_threads(self) -> int:
        """Threads launched: blocks x threads per block (over every grid dimension)."""
        return _volume(self.blocks) * _volume(self.threads)


def _volume(dims: Any) -> int:
    return math.prod(dims) if isinstance(dims, tuple | list) else int(dims)


class Launches:
    """Every kernel launch on the stand-in device while :func:`recording` is active (a list of
    :class:`LaunchRecord`), for tests of grid sizes and for the compile report's signatures
    (:mod:`gpuc._testing.kernel_report`).
    """

    active: ClassVar[list[list[LaunchRecord]]] = []


@contextlib.contextmanager
def recording() -> Iterator[list[LaunchRecord]]:
    """Record the stand-in's kernel launches inside the block (nested blocks each get every launch)."""
    out: list[LaunchRecord] = []
    Launches.active.append(out)
    try:
        yield out
    finally:
        Launches.active.remove(out)


def _view(a: Any) -> np.ndarray:
    """The stand-in's device view of a kernel argument (:meth:`gpuc._backend.Backend.launch` counts them): the host
    array behind a :class:`DeviceArray`, which the CUDA simulator runs on. Sparse matrices and host arrays are refused.
    """
    if isinstance(a, DeviceSparse):
        msg = "stand-in GPU: a kernel was given a sparse matrix; pass its data / indices / indptr arrays."
        raise TypeError(msg)
    if isinstance(a, np.ndarray):
        msg = f"stand-in GPU: a kernel was given a host array {a.shape}; upload it with xp.asarray."
        raise HostArrayError(msg)
    return a._a


def _launch(kernel: Any, blocks: Any, threads: Any, shared_bytes: int, args: tuple) -> None:
    """Run a numba-cuda kernel on stand-in device arrays (their views, :func:`_view`) under the CUDA simulator
    (counted as one operation; recorded while :func:`recording`).
    """
    ok, reason = simulator_status()
    if not ok:
        msg = f"stand-in GPU: cannot launch a custom kernel: {reason}."
        raise RuntimeError(msg)
    func = getattr(kernel, "py_func", kernel)
    name = getattr(func, "__name__", "kernel")
    Counts.op(f"kernel.{name}")
    if Launches.active:
        import numba

        kernel_id = f"{getattr(func, '__module__', '?')}.{name}"
        rec = LaunchRecord(name, kernel_id, blocks, threads, shared_bytes, tuple(numba.typeof(a) for a in args))
        for out in Launches.active:
            out.append(rec)
    kernel[blocks, threads, 0, shared_bytes](*args)


_launch.view = _view  # type: ignore[attr-defined]


@functools.cache
def standin_backend() -> Any:
    """A :class:`gpuc._backend.Backend` named ``"gpu"`` over the stand-in namespaces.

    Custom kernels launched through its :meth:`~gpuc._backend.Backend.launch` run under numba-cuda's CUDA simulator
    (:func:`simulator_status` says whether it is active).
    """
    from gpuc._backend import Backend, register_device_types

    register_device_types(dense=DeviceArray, sparse=DeviceSparse)
    return Backend("gpu", xp, sparse, special, sparse_linalg, launcher=_launch)


def to_device(x: Any) -> Any:
    """Upload a host array (dense or sparse) to the stand-in device."""
    return standin_backend().asarray(x)


@contextlib.contextmanager
def use_standin() -> Iterator[Any]:
    """Within the block, the GPU is the stand-in: ``device="gpu"`` and device-resident data resolve to it.

    Yields the stand-in backend. Patches :mod:`gpuc._backend`'s device lookup only (undone on exit).
    """
    from gpuc import _backend

    bk = standin_backend()
    saved = _backend._backend_for, _backend.gpu_status
    real = saved[0]

    def backend_for(name: str) -> Any:
        return bk if name == "gpu" else real(name)

    _backend._backend_for = backend_for
    _backend.gpu_status = lambda: (True, "stand-in GPU (gpuc._testing.standin)")
    try:
        yield bk
    finally:
        _backend._backend_for, _backend.gpu_status = saved
