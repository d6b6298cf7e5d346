"""torch and CUDA, when they are there: the import, the devices by UUID, dtypes, and pinning host memory.

Nothing here fails at import: without torch, ``torch_or_none`` is None and ``require_torch`` raises
TransportUnavailable saying what to install. A torch that is installed but does not import (a CUDA
library missing, a broken build: an OSError, a ValueError) counts as no torch, said once in the log
with its cause; ``torch_installed`` is then False, so a server does not offer the GPU path.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from functools import cache
from types import ModuleType

from kvdepot.errors import TransportUnavailable

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvdepot[gpu]' (torch with CUDA)"


_import_failure: str | None = None  # why an installed torch did not import (torch_or_none)


@cache
def torch_or_none() -> ModuleType | None:
    global _import_failure
    try:
        import torch
    except ImportError:
        return None
    except Exception as exc:  # installed, and broken: a missing CUDA library (OSError), a bad build (ValueError)
        _import_failure = f"{type(exc).__name__}: {exc}"
        log.warning("kvdepot: torch is installed but does not import (%s): no GPU path in this process", _import_failure)
        return None
    return torch


def torch_installed() -> bool:
    """Is torch there to import? (without importing it: a server on a machine without a GPU never pays
    for torch's import until a worker registers a host cache; False once an import of it has failed)"""
    return _import_failure is None and importlib.util.find_spec("torch") is not None


def nvidia_driver_present() -> bool:
    """Does this machine (or container) expose an NVIDIA driver or device? Cheap, and no torch: a server
    imports torch for CUDA only where this holds."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def require_torch(what: str) -> ModuleType:
    """torch, or TransportUnavailable naming ``what`` needed it and how to get it."""
    torch = torch_or_none()
    if torch is None:
        if _import_failure is not None:
            raise TransportUnavailable(f"{what} needs torch in this process, and it is installed but does not import ({_import_failure})")
        raise TransportUnavailable(f"{what} needs torch in this process, and it is not installed: {INSTALL_HINT}")
    return torch


def cuda_available() -> bool:
    torch = torch_or_none()
    try:
        return torch is not None and torch.cuda.is_available()
    except Exception:  # a broken driver: no CUDA, said once by whoever asks for a device
        return False


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it: the name both processes agree on
    (CUDA_VISIBLE_DEVICES may number the same GPU differently in the worker and the server)."""
    torch = require_torch("naming a CUDA device")
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_devices() -> dict[str, int]:
    """UUID -> this process's index, for every CUDA device it sees ({} without CUDA; torch is not even
    imported where no NVIDIA driver is present)."""
    if not nvidia_driver_present() or not cuda_available():
        return {}
    torch = torch_or_none()
    return {device_uuid(i): i for i in range(torch.cuda.device_count())}


# --- dtypes --------------------------------------------------------------------------------------------

# A cache's dtype by name, and the integer type of the same width its bits are moved as: copies never look
# at values, and index_select/index_copy_ exist for integers on every device (not for fp8 on every one).
_BITS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def torch_dtype(name: str):
    torch = require_torch("a paged cache")
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def bits_dtype(dtype):
    """The integer dtype of ``dtype``'s width (what its bits are copied as)."""
    torch = require_torch("a paged cache")
    return getattr(torch, _BITS[torch.empty((), dtype=dtype).element_size()])


# --- pinned host memory ----------------------------------------------------------------------------------

# CUDA refuses to register a range twice (cudaErrorHostMemoryAlreadyRegistered), and a refused call leaves
# its error as the thread's "last error", which torch's next allocation or launch raises as its own. So a
# process registers each range once, shared by every holder (two DeviceKVs of one client, a writer and a
# reader), and unregisters it when the last holder lets go.
_pins: dict[tuple[int, int], int] = {}  # (address, size) -> holders
_pins_lock = threading.Lock()


@dataclass
class PinnedRange:
    """A holder of host memory registered with CUDA (``cudaHostRegister``): copies to and from it are DMA,
    and ``non_blocking`` copies really run beside the host. ``close`` lets go (the last holder unregisters,
    before the memory is unmapped)."""

    address: int
    size: int
    pinned: bool

    def close(self) -> None:
        if not self.pinned:
            return
        self.pinned = False
        key = (self.address, self.size)
        with _pins_lock:
            holders = _pins.get(key, 0) - 1
            if holders > 0:
                _pins[key] = holders
                return
            _pins.pop(key, None)
            torch = torch_or_none()
            if torch is not None:
                _cuda_call(torch.cuda.cudart().cudaHostUnregister(self.address))


CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable


def pin(address: int, size: int) -> PinnedRange:
    """Register ``size`` bytes at ``address`` with CUDA (it faults every page in and locks it), or hold the
    registration this process already made of exactly that range. A failure (no CUDA, a memlock limit,
    a range overlapping another registration) is logged and leaves the range pageable: copies then go
    through the driver's own bounce buffer, correct and slower."""
    if not cuda_available():
        return PinnedRange(address, size, False)
    torch = torch_or_none()
    key = (address, size)
    with _pins_lock:
        if key in _pins:
            _pins[key] += 1
            return PinnedRange(address, size, True)
        # Portable: pinned for every device's context, not only the current one (a server pins its arena
        # once and copies for caches on any of the host's GPUs).
        code = _cuda_call(torch.cuda.cudart().cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE))
        if code != 0:
            log.warning("kvdepot: cudaHostRegister of %d MiB failed (CUDA error %d); copies use pageable memory (slower)", size >> 20, code)
            return PinnedRange(address, size, False)
        _pins[key] = 1
    return PinnedRange(address, size, True)


def _cuda_call(err) -> int:
    """The error code of a CUDA runtime call made through torch's ``cudart()``; a failure's "last error" is
    consumed here, so torch never raises it later as the error of some unrelated call."""
    code = int(getattr(err, "value", err))
    if code != 0:
        _clear_last_error()
    return code


@cache
def _cudart_library():
    """The CUDA runtime library torch loaded in this process (its "last error" is the one torch checks)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
            if os.path.basename(path).startswith("libcudart.so"):
                return ctypes.CDLL(path)
    return None


def _clear_last_error() -> None:
    try:
        lib = _cudart_library()
        if lib is not None:
            lib.cudaGetLastError()
            return
    except OSError:
        pass
    # A runtime linked into torch itself: a kernel launch's check consumes (and raises) the pending error.
    torch = torch_or_none()
    try:
        torch.ones(1, device="cuda")
    except Exception:
        pass
