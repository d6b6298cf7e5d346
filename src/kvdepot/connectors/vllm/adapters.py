"""What a LoRA adapter contributes to a request's keys: the root of its chunk-hash chain.

A LoRA adapter changes every layer's K and V (it adapts the attention projections), so a prompt's KV
under adapter X is not its KV under the base model or under adapter Y. kvdepot's keys hash tokens, so a
LoRA request's chain starts from a *root* that names the adapter, where a base request's starts from
nothing: ``h[0] = H(root || tokens of chunk 0)``. A root is 32 bytes of sha256 over a domain tag and
the adapter's content, so no base chain's link can equal it.

The adapter is named by what vLLM loads from it (its ``adapter_config.json`` and weight files), not by
the name or path a request gives: kvdepot keeps KV across engine restarts and machines, where a name
may be reused for new weights (vLLM's own prefix cache lives and dies with one engine, so name and path
are enough for it). The same weights under two names or two paths share their KV; new weights at the
same path get new keys once an engine reads them.

Each adapter (by vLLM's (name, path), the pair its own prefix hashes carry) is hashed once per
scheduler, on its first request, and kept for the engine's life: vLLM keeps the weights it loaded for as
long, so files replaced under a running engine must not change the keys of what it still computes with
the old ones (a restart re-reads both). The exception is a request with ``load_inplace``, on which vLLM
reloads the files: its root follows the files' sizes and modification times, hashed again when they
change. A hub id is read from the Hugging Face cache, where vLLM's workers download it: until they have
(its first requests), it has no root, and it is looked for again every ``RETRY_S``. An adapter kvdepot
cannot read here otherwise (a path that is not a directory; a tensorizer-loaded one; no weights file)
has no root for good. Without a root, requests are served uncached, said once per adapter.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

ROOT_TAG = b"kvdepot/lora-adapter/1\0"
CONFIG_FILE = "adapter_config.json"
# What vLLM reads from a PEFT adapter directory (LoRAModel.from_local_checkpoint): the first weights
# file found of the first three, and the new-embeddings file if there is one.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
EMBEDDING_FILES = ("new_embeddings.safetensors", "new_embeddings.bin")
READ_BYTES = 1 << 20
RETRY_S = 30.0  # a hub adapter not in the local cache yet: how long until it is looked for again


class AdapterRoots:
    """Adapter -> chain root (or None: uncacheable), computed once per (name, path) and kept."""

    def __init__(self, clock=time.monotonic) -> None:
        self._roots: dict[tuple, bytes | None] = {}
        self._retry_at: dict[tuple, float] = {}  # hub adapters not downloaded yet: when to look again
        self._said: set[tuple] = set()  # adapters whose lack of a root was logged
        self._clock = clock

    def __repr__(self) -> str:
        return f"AdapterRoots({len(self._roots)} adapters)"

    def root(self, lora_request: Any) -> bytes | None:
        """The chain root of ``lora_request`` (a vLLM ``LoRARequest``); None: serve it uncached."""
        key: tuple = (str(lora_request.lora_name), str(lora_request.lora_path))
        if getattr(lora_request, "load_inplace", False):
            key += (_signature(os.path.expanduser(key[1])),)
        retry = self._retry_at.get(key)
        if key not in self._roots or (retry is not None and self._clock() >= retry):
            self._retry_at.pop(key, None)
            self._roots[key] = self._compute(key, lora_request)
        return self._roots[key]

    def _without_root(self, key: tuple, level: int, message: str, *args) -> None:
        if key not in self._said:
            self._said.add(key)
            log.log(level, message, *args)

    def _compute(self, key: tuple, lora_request: Any) -> bytes | None:
        name, path = lora_request.lora_name, lora_request.lora_path
        if getattr(lora_request, "tensorizer_config_dict", None):
            self._without_root(key, logging.INFO, "kvdepot: LoRA adapter %r is loaded by tensorizer: its requests are not cached "
                               "(its weights are not files kvdepot can name)", name)  # fmt: skip
            return None
        directory = os.path.expanduser(str(path))
        if not os.path.isdir(directory):
            cached = None if os.path.isabs(directory) else _hub_snapshot(str(path))
            if cached is None:
                if not os.path.isabs(directory):
                    self._retry_at[key] = self._clock() + RETRY_S
                self._without_root(key, logging.INFO, "kvdepot: LoRA adapter %r (%s) is not a local directory or a downloaded hub "
                                   "adapter here: its requests are not cached until it is (kvdepot names an adapter by its files)",
                                   name, path)  # fmt: skip
                return None
            directory = cached
        try:
            digest = adapter_digest(directory)
        except OSError as exc:
            self._without_root(key, logging.WARNING, "kvdepot: LoRA adapter %r (%s) could not be read (%s): its requests are not cached",
                               name, path, exc)  # fmt: skip
            return None
        if digest is None:
            self._without_root(key, logging.INFO, "kvdepot: LoRA adapter %r (%s) has no %s and weights file kvdepot knows: its "
                               "requests are not cached", name, path, CONFIG_FILE)  # fmt: skip
            return None
        log.info("kvdepot: LoRA adapter %r (%s): its requests are cached under content digest %s", name, path, digest.hex()[:16])
        return hashlib.sha256(ROOT_TAG + digest).digest()


def adapter_digest(directory: str) -> bytes | None:
    """sha256 over the files vLLM loads from a PEFT adapter directory, each framed by its name and size
    (so bytes cannot move between files unnoticed); None when the config or the weights are missing."""
    weights = next((f for f in WEIGHT_FILES if os.path.isfile(os.path.join(directory, f))), None)
    if weights is None or not os.path.isfile(os.path.join(directory, CONFIG_FILE)):
        return None
    files = [CONFIG_FILE, weights] + [f for f in EMBEDDING_FILES if os.path.isfile(os.path.join(directory, f))]
    h = hashlib.sha256()
    for name in files:
        with open(os.path.join(directory, name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(b"%s\0%d\0" % (name.encode(), size))
            read = 0
            while chunk := f.read(READ_BYTES):
                h.update(chunk)
                read += len(chunk)
            if read != size:
                raise OSError(f"{name} changed size while it was read ({size} -> {read} bytes)")
    return h.digest()


def _signature(directory: str) -> tuple:
    """(name, size, mtime) of the files ``adapter_digest`` would read: what a reload in place changes."""
    out = []
    for name in (CONFIG_FILE, *WEIGHT_FILES, *EMBEDDING_FILES):
        try:
            st = os.stat(os.path.join(directory, name))
        except OSError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _hub_snapshot(repo_id: str) -> str | None:
    """The local snapshot of a Hugging Face hub adapter, if one was downloaded (as vLLM's workers do);
    never a download here: the scheduler must not wait on the network."""
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(repo_id=repo_id, local_files_only=True)
    except Exception:  # not an id, not cached, no huggingface_hub: all "not here"
        return None
    return found if os.path.isdir(found) else None
