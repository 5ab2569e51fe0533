"""Kernel launches with programmatic dependent launch (PDL, compute capability 9.0+).

A decode step is a chain of small kernels, each reading what the previous one wrote. Launched the ordinary way,
a kernel's blocks start only once the previous kernel has finished entirely: its last blocks, the launch and the
new blocks' first memory loads are all serial. With PDL (the launch attribute "programmatic stream
serialization"), the next kernel's blocks start while the previous one finishes and do the work that does not
need its results (reading descriptors, asking L2 for their weights and KV rows) before `griddepcontrol.wait`
(kernels/common.cuh grid_dep_wait). CUDA graphs capture the attribute as a programmatic edge.

CuPy launches through cuLaunchKernel, which takes no attributes, so a dependent launch calls the driver's
cuLaunchKernelEx through ctypes with the CUfunction CuPy compiled and loaded.

Only kernels that call grid_dep_wait() before touching activations may be launched this way (cuda_ops passes
`dependent=True` for those), and only after another kernel: `dependent_launches(True)` turns it on for what the
engine records, `copy` marks the copies in between."""

from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("n_attrs", ctypes.c_uint)]


class _State:
    enabled = False  # inside dependent_launches(True)
    after_kernel = False  # the last thing recorded was a kernel


_state = _State()
_driver: Any = None


def _cuda_driver() -> Any:
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                         ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        _driver = lib
    return _driver


def supported() -> bool:
    """PDL is asked for (NINFER_CUDA_PDL unset or 1), the GPU has it (9.0+) and the driver has cuLaunchKernelEx."""
    if os.environ.get("NINFER_CUDA_PDL", "1") == "0":
        return False
    import cupy as cp

    if int(cp.cuda.Device().compute_capability) < 90:
        return False
    try:
        return hasattr(_cuda_driver(), "cuLaunchKernelEx")
    except OSError:
        return False


@contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """Launch the kernels that support it as programmatic dependents of the kernel before them."""
    saved = (_state.enabled, _state.after_kernel)
    _state.enabled, _state.after_kernel = on, False
    try:
        yield
    finally:
        _state.enabled, _state.after_kernel = saved


_C_TYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.int32): ctypes.c_int32, np.dtype(np.float32): ctypes.c_float}


def _c_arg(a: Any) -> ctypes._SimpleCData | ctypes.Array:
    if isinstance(a, np.void):  # a C struct passed by value: its bytes (a structured dtype laid out as C's)
        return (ctypes.c_char * a.dtype.itemsize).from_buffer_copy(a.tobytes())
    if isinstance(a, np.generic):
        return _C_TYPES[a.dtype](a.item())
    if hasattr(a, "data") and hasattr(a.data, "ptr"):  # a CuPy array: its device pointer
        return ctypes.c_uint64(a.data.ptr)
    raise TypeError(f"kernel argument of type {type(a).__name__}: wrap scalars in their numpy type")


def kernel(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0,
           dependent: bool = False) -> None:
    """Launch `fn` (a CuPy RawKernel) on CuPy's current stream; as a programmatic dependent of the previous
    kernel when `dependent` (the kernel waits for it itself) and dependent_launches is on. A structured numpy
    scalar (np.void) in `args` is a struct passed by value; those launches go through the driver here too."""
    pdl = dependent and _state.enabled and _state.after_kernel
    if not pdl and not any(isinstance(a, np.void) for a in args):
        fn(grid, block, args, shared_mem=shared_mem)
        _state.after_kernel = True
        return
    import cupy as cp

    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    attr = _LaunchAttribute(id=_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
                        ctypes.c_void_p(cp.cuda.get_current_stream().ptr), ctypes.pointer(attr), int(pdl))
    values = [_c_arg(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    drv = _cuda_driver()
    rc = drv.cuLaunchKernelEx(ctypes.byref(cfg), ctypes.c_void_p(fn.kernel.ptr), params, None)
    if rc != 0:
        name = ctypes.c_char_p()
        drv.cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"cuLaunchKernelEx of {fn.name}: {(name.value or b'?').decode()} ({rc})")
    _state.after_kernel = True


def copy(dst: int, src: int, nbytes: int, kind: int) -> None:
    """cudaMemcpyAsync on CuPy's current stream (the next kernel then starts the ordinary way)."""
    import cupy as cp

    cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, cp.cuda.get_current_stream().ptr)
    _state.after_kernel = False
