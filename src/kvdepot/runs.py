"""Copy many arrays into many others while this thread keeps the GIL.

``np.copyto`` lets go of the GIL for every copy of any size. In a process where another thread runs
Python while we copy (SGLang's scheduler loop, vLLM's engine core), each copy then waits to get the GIL
back, up to the interpreter's switch interval (5 ms), before the next one may start: a read of 63 pages
spent more time waiting than copying (measured inside SGLang: ``benchmarks/sglang_ttft.py``).

``copy_all(pairs)`` copies each pair as its contiguous runs with ``memmove`` called through ``ctypes``'s
``PyDLL``, which keeps the GIL: no wait between runs, and the copy is as long as the bytes take. The
other threads still get the GIL at the interpreter's switch interval (between two runs), as from any
thread running Python. A pair whose runs are short (below ``MIN_RUN_BYTES``: the call would cost more
than the bytes) is copied by ``np.copyto``.

A ``RunPlan`` is computed once per (shape, strides, strides, item size) and reused: every page of one
pool, every chunk of one layout has the same.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

MIN_RUN_BYTES = 16 << 10


def _memmove():
    fn = ctypes.PyDLL(None).memmove  # PyDLL: the call keeps the GIL (CDLL would release it)
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_void_p
    return fn


_MEMMOVE = _memmove()


@dataclass(frozen=True)
class RunPlan:
    """Where the contiguous runs of one array shape lie in a destination and a source array: run ``i``
    is ``run_bytes`` long at ``dst_offsets[i]`` and ``src_offsets[i]`` bytes from each array's start."""

    dst_offsets: tuple[int, ...]
    src_offsets: tuple[int, ...]
    run_bytes: int


@functools.lru_cache(maxsize=256)
def plan(shape: tuple[int, ...], dst_strides: tuple[int, ...], src_strides: tuple[int, ...], itemsize: int) -> RunPlan | None:
    """The runs, or None where they are shorter than ``MIN_RUN_BYTES``."""
    # The trailing axes that are contiguous in both arrays make one run.
    run = itemsize
    inner = len(shape)
    while inner > 0 and (shape[inner - 1] == 1 or (dst_strides[inner - 1] == run and src_strides[inner - 1] == run)):
        inner -= 1
        run *= shape[inner]
    if run < MIN_RUN_BYTES or 0 in shape:
        return None
    outer = [range(n) for n in shape[:inner]]
    dst, src = [], []
    for index in itertools.product(*outer):
        dst.append(sum(i * s for i, s in zip(index, dst_strides)))
        src.append(sum(i * s for i, s in zip(index, src_strides)))
    return RunPlan(tuple(dst), tuple(src), run)


def copy_all(pairs: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
    """``dst[...] = src`` for each ``(dst, src)``: same shape, same item size, no conversion."""
    memmove = _MEMMOVE
    for dst, src in pairs:
        if dst.shape != src.shape or dst.dtype.itemsize != src.dtype.itemsize:
            raise ValueError(f"cannot copy {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
        if not dst.flags.writeable:
            raise ValueError("the destination is read-only")
        runs = plan(dst.shape, dst.strides, src.strides, dst.dtype.itemsize)
        if runs is None:
            np.copyto(dst, src.view(dst.dtype), casting="no")
            continue
        d, s, n = dst.ctypes.data, src.ctypes.data, runs.run_bytes
        for do, so in zip(runs.dst_offsets, runs.src_offsets):
            memmove(d + do, s + so, n)
