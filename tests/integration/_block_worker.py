"""A worker process for tests/integration/test_block_transfer.py: registers a host paged cache (a
``HostCacheFile`` in the server's shm dir) filled from a seed, stores ``chunks`` chunks of the seed's
tokens through the server-driven path, says so on stdout (one JSON line), then waits to be killed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from kvdepot import ClientOptions, KVClient, KVLayout
from kvdepot.gpu.memory import HostCacheFile

url, seed, chunks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path[:0] = [sys.argv[4], str(Path(sys.argv[4]).parent)]  # tests/integration (the shared geometry) and tests (support)
from test_block_transfer import BS, CHUNK, LAYOUT, MODEL, NB, fill, tokens  # noqa: E402

with KVClient(url, MODEL, LAYOUT, options=ClientOptions(chunk_size=CHUNK, timeout_s=10.0)) as client:
    cache = HostCacheFile.create(client.registration.blocks.shm_dir, LAYOUT.num_layers, (2, NB, BS, LAYOUT.num_kv_heads, LAYOUT.head_dim), torch.bfloat16)
    fill(cache.layers, seed)
    registered = client.register_kv_cache(cache.layers, "kv_first", BS)
    ids = list(range(chunks * CHUNK // BS))
    statuses = registered.store(client.hashes(tokens(seed, chunks)), [ids])
    print(json.dumps({"path": cache.path, "cache_id": registered.cache_id, "stored": [s.name for s in statuses]}), flush=True)
    while True:
        time.sleep(1)
