"""A cache never reinterprets KV of one dtype as another: float16 bytes stored under a bfloat16 layout
read back as garbage (1.0 becomes 0.0078). Dtypes must match exactly (numpy, torch, ml_dtypes' bfloat16;
the raw unsigned bits only when the caller says so), token counts must match the token ids, and a
refused call stores nothing."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from kvdepot import KVLayout
from kvdepot.errors import BadRequest

from support.servers import CHUNK, make_tokens

BF16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16")
FP16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16")
N = 2 * CHUNK


def ones(layout: KVLayout, dtype, n: int = N) -> np.ndarray:
    return np.ones(layout.chunk_shape(n), dtype=dtype)


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize(
    "layout, wrong",
    [(BF16, np.float16), (BF16, np.int16), (BF16, np.uint16), (FP16, np.int16), (FP16, np.uint16), (FP16, ml_dtypes.bfloat16)],
    ids=["f16->bf16", "i16->bf16", "u16->bf16", "i16->f16", "u16->f16", "bf16->f16"],
)
def test_a_wrong_dtype_is_refused_naming_both(server, transport, layout, wrong, seed):
    tokens = make_tokens(N, seed)
    with server.client(transport=transport, layout=layout) as c:
        with pytest.raises(BadRequest) as exc_info:
            c.store(tokens, ones(layout, wrong))
        message = str(exc_info.value)
        assert np.dtype(wrong).name in message and layout.dtype in message
        assert c.lookup(tokens) == 0, "a refused store stored something"
        with pytest.raises(BadRequest):  # torch tensors are checked the same way
            c.store(tokens, torch.ones(layout.chunk_shape(N), dtype=torch.float16 if layout is BF16 else torch.bfloat16))
        assert c.lookup(tokens) == 0


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_bfloat16_goes_in_as_bfloat16_and_its_raw_bits_only_when_said(server, transport, seed):
    with server.client(transport=transport, layout=BF16) as c:
        t1, t2, t3 = (make_tokens(N, seed + i) for i in range(3))
        assert c.store(t1, torch.full(BF16.chunk_shape(N), 1.0, dtype=torch.bfloat16)) == N
        assert c.store(t2, ones(BF16, ml_dtypes.bfloat16)) == N
        raw = ones(BF16, ml_dtypes.bfloat16).view(np.uint16)
        with pytest.raises(BadRequest, match="raw=True"):
            c.store(t3, raw)
        assert c.store(t3, raw, raw=True) == N
        for t in (t1, t2, t3):
            got = c.retrieve(t)  # raw bits, as uint16
            assert got.dtype == np.uint16
            assert (got.view(ml_dtypes.bfloat16) == 1.0).all(), "1.0 did not come back as 1.0"
        out = torch.empty(BF16.chunk_shape(N), dtype=torch.bfloat16)
        c.retrieve(t1, out=out)
        assert bool((out == 1.0).all())
        with pytest.raises(BadRequest):
            c.retrieve(t1, out=np.empty(BF16.chunk_shape(N), np.float16))
        with pytest.raises(BadRequest, match="raw=True"):
            c.retrieve(t1, out=np.empty(BF16.chunk_shape(N), np.uint16))
        assert c.retrieve(t1, out=np.empty(BF16.chunk_shape(N), np.uint16), raw=True).shape[2] == N


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("kv_tokens", [N + 5, N + CHUNK, N - 1])
def test_kv_must_hold_exactly_as_many_tokens_as_the_ids(server, transport, kv_tokens, seed):
    tokens = make_tokens(N, seed)
    with server.client(transport=transport, layout=FP16) as c:
        with pytest.raises(BadRequest, match=f"{kv_tokens} tokens"):
            c.store(tokens, ones(FP16, np.float16, kv_tokens))
        assert c.lookup(tokens) == 0
        assert c.store(tokens, ones(FP16, np.float16, N)) == N
