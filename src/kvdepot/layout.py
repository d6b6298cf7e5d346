"""KVLayout: what one token's KV looks like, and therefore what a chunk object is.

A chunk is a contiguous array ``[K, L, T, H, D]``: K = 2 (keys, values; 1 for MLA's shared latent),
L layers, T = chunk_size tokens, H KV heads, D head dim. Every object of a context has the same
byte size, so the server can check payload sizes without looking inside them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

# dtype name -> numpy dtype used to hold the bytes. numpy has no bfloat16 or fp8: those travel as
# same-width unsigned integers, which is all a cache needs (it never does arithmetic on them).
_STORAGE_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(np.uint8),
    "float8_e5m2": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
}


class PagedFormat(str, Enum):
    """How one layer of an engine's paged KV cache is laid out (each is read as ``[K, blocks, block_size,
    H, D]`` without a copy). Both the engine side and the server (the server-driven path) read it."""

    KV_FIRST = "kv_first"  # [K, num_blocks, block_size, H, D]: vLLM's FlashAttention layout
    BLOCK_FIRST = "block_first"  # [num_blocks, K, block_size, H, D]: FlashInfer's
    HEAD_MAJOR = "head_major"  # [num_blocks, H, K*block_size, D]: per head, the block's K rows then its V rows


def supported_dtypes() -> list[str]:
    return sorted(_STORAGE_DTYPES)


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    use_mla: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _STORAGE_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {supported_dtypes()}")

    @property
    def kv_factor(self) -> int:
        return 1 if self.use_mla else 2

    @property
    def storage_dtype(self) -> np.dtype:
        return _STORAGE_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.storage_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.kv_factor * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (self.kv_factor, self.num_layers, num_tokens, self.num_kv_heads, self.head_dim)

    def chunk_bytes(self, chunk_size: int) -> int:
        return self.bytes_per_token * chunk_size

    def fingerprint(self) -> str:
        """A stable string naming everything that decides how the bytes are to be read."""
        return (
            f"{self.dtype}:K{self.kv_factor}xL{self.num_layers}xH{self.num_kv_heads}xD{self.head_dim}"
        )

    def empty(self, num_tokens: int) -> np.ndarray:
        return np.empty(self.chunk_shape(num_tokens), dtype=self.storage_dtype)

    def view_chunk(self, buffer, chunk_size: int, writable: bool = True) -> np.ndarray:
        """An ndarray ``[K, L, chunk_size, H, D]`` over ``buffer`` (no copy)."""
        arr = np.frombuffer(buffer, dtype=self.storage_dtype, count=self.chunk_bytes(chunk_size) // self.itemsize)
        arr = arr.reshape(self.chunk_shape(chunk_size))
        if not writable:
            arr.flags.writeable = False
        return arr


def dtype_name(array) -> str:
    """The logical dtype of a numpy array or torch tensor: 'float16', 'bfloat16' (torch, or numpy with
    ml_dtypes), 'uint16', ..."""
    if isinstance(array, np.ndarray):
        return array.dtype.name
    if type(array).__module__.startswith("torch"):
        return str(array.dtype).removeprefix("torch.")
    return np.asarray(array).dtype.name


def kv_array(array, layout: KVLayout, raw: bool = False) -> np.ndarray:
    """``array`` (numpy or a CPU torch tensor) as a numpy view of ``layout``'s storage dtype, after
    checking that its dtype is exactly the layout's: the bytes of a float16 array are not bfloat16 KV,
    and a cache must never reinterpret one as the other. ``raw=True`` also accepts the same-width
    unsigned integers that hold the layout's bits (what kvdepot hands back for bfloat16 and fp8).
    Raises BadRequest naming both dtypes."""
    from kvdepot.errors import BadRequest

    have = dtype_name(array)
    raw_name = f"uint{layout.itemsize * 8}"
    if have != layout.dtype and not (raw and have == raw_name):
        hint = f"; pass raw=True if it holds the raw {layout.dtype} bits" if have == raw_name else ""
        raise BadRequest(f"kv has dtype {have} but the layout stores {layout.dtype}{hint}")
    arr = as_numpy(array)
    if arr.dtype != layout.storage_dtype:
        arr = arr.view(layout.storage_dtype)  # same width, checked above: a reinterpretation of the name only
    return arr


def as_numpy(array) -> np.ndarray:
    """Accept a numpy array or a CPU torch tensor; return a numpy view sharing its memory (no copy)."""
    if isinstance(array, np.ndarray):
        return array
    module = type(array).__module__
    if module.startswith("torch"):
        import torch

        tensor = array.detach()
        if tensor.device.type != "cpu":
            raise ValueError(f"only CPU tensors can be viewed as numpy, got device {tensor.device}")
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.view(torch.uint16)  # the same width KVLayout uses for bf16
        elif tensor.dtype in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
            tensor = tensor.view(torch.uint8)
        return tensor.numpy()
    return np.asarray(array)
