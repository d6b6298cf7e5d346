"""torch and CUDA, when they are there: the import, the devices by UUID, dtypes, and pinning host memory.

Nothing here fails at import: without torch, ``torch_or_none`` is None and ``require_torch`` raises
TransportUnavailable saying what to install.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from dataclasses import dataclass
from functools import cache
from types import ModuleType

from kvdepot.errors import TransportUnavailable

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'kvdepot[gpu]' (torch with CUDA)"


@cache
def torch_or_none() -> ModuleType | None:
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_installed() -> bool:
    """Is torch there to import? (without importing it: a server on a machine without a GPU never pays
    for torch's import until a worker registers a host cache)"""
    return importlib.util.find_spec("torch") is not None


def nvidia_driver_present() -> bool:
    """Does this machine (or container) expose an NVIDIA driver or device? Cheap, and no torch: a server
    imports torch for CUDA only where this holds."""
    return os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))


def require_torch(what: str) -> ModuleType:
    """torch, or TransportUnavailable naming ``what`` needed it and how to get it."""
    torch = torch_or_none()
    if torch is None:
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


@dataclass
class PinnedRange:
    """Host memory registered with CUDA (``cudaHostRegister``): copies to and from it are DMA, and
    ``non_blocking`` copies really run beside the host. ``close`` unregisters it (before it is unmapped)."""

    address: int
    size: int
    pinned: bool

    def close(self) -> None:
        if self.pinned:
            self.pinned = False
            torch = torch_or_none()
            if torch is not None:
                torch.cuda.cudart().cudaHostUnregister(self.address)


def pin(address: int, size: int) -> PinnedRange:
    """Register ``size`` bytes at ``address`` with CUDA (it faults every page in and locks it). A failure
    (no CUDA, a memlock limit) is logged and leaves the range pageable: copies then go through the driver's
    own bounce buffer, correct and slower."""
    if not cuda_available():
        return PinnedRange(address, size, False)
    torch = torch_or_none()
    err = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        log.warning("kvdepot: cudaHostRegister of %d MiB failed (CUDA error %d); copies use pageable memory (slower)", size >> 20, code)
        return PinnedRange(address, size, False)
    return PinnedRange(address, size, True)
