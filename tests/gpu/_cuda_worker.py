"""A GPU worker process for tests/gpu: registers a CUDA paged cache with the server (CUDA IPC), stores
two chunks, says so (one JSON line), then waits to be killed."""

from __future__ import annotations

import json
import sys
import time

import torch

from kvdepot import ClientOptions, KVClient, KVLayout

url = sys.argv[1]
layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
with KVClient(url, "gpu-worker-model", layout, options=ClientOptions(chunk_size=32, timeout_s=30.0)) as client:
    layers = [torch.randn(2, 16, 16, 2, 64, device="cuda").to(torch.bfloat16) for _ in range(2)]
    torch.cuda.synchronize()
    cache = client.register_kv_cache(layers, "kv_first", 16)
    statuses = cache.store(client.hashes(list(range(64))), [[0, 1, 2, 3]])
    print(json.dumps({"kind": cache.kind, "stored": [s.name for s in statuses]}), flush=True)
    while True:
        time.sleep(1)
