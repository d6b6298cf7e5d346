"""Pinned copies between a GPU and each kind of host memory kvdepot could copy through.

The L1 arena is a shared-memory file that the server creates and every client maps a second time; a GPU
copies to and from it after ``cudaHostRegister``. This times 16 copies of 32 MiB each way for:

- ``cudaHostAlloc`` (torch's ``pin_memory``): the driver's own pinned memory, the usual limit;
- anonymous memory, registered (with and without ``MADV_HUGEPAGE``);
- a /dev/shm file reserved with ``posix_fallocate`` and mapped twice (the arena as it is made today);
- a /dev/shm file advised ``MADV_HUGEPAGE`` before its pages are faulted in (huge pages where the
  kernel's ``shmem_enabled`` allows them), mapped twice.

It prints the kernel's transparent-huge-page settings and how much of each mapping huge pages back, so
a difference can be put down to page size or not.

    python benchmarks/gpu_host_memory.py [--mib 32] [--chunks 16]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile

import torch

from kvdepot.bench.stats import gbps, timed
from kvdepot.gpu import runtime

MADV_POPULATE_WRITE = 23


def thp_settings() -> str:
    out = []
    for name in ("enabled", "shmem_enabled"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                out.append(f"{name}: {f.read().strip()}")
        except OSError:
            out.append(f"{name}: unreadable")
    return "; ".join(out)


def huge_kib(address: int) -> str:
    """AnonHugePages / ShmemPmdMapped of the mapping that holds ``address`` (from /proc/self/smaps)."""
    found, fields = False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if found:
                    break
                found = lo <= address < hi
                continue
            if found and head[0].rstrip(":") in ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped", "Rss"):
                fields[head[0].rstrip(":")] = int(head[1])
    return ", ".join(f"{k} {v >> 10} MiB" for k, v in fields.items() if v)


def shm_mapping(size: int, huge: bool) -> tuple[mmap.mmap, mmap.mmap, str]:
    fd, path = tempfile.mkstemp(prefix="kvdepot-hostmem-", dir="/dev/shm")
    os.ftruncate(fd, size)
    if not huge:
        os.posix_fallocate(fd, 0, size)
    creator = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    user = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)  # the client's own mapping
    os.close(fd)
    if huge:
        for mm in (creator, user):
            mm.madvise(mmap.MADV_HUGEPAGE)
    creator.madvise(MADV_POPULATE_WRITE)  # the creator faults every page in, as the server pre-faults its arena
    return creator, user, path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=32)
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    if not runtime.cuda_available():
        raise SystemExit("this needs an NVIDIA GPU and torch with CUDA")
    chunk, n = args.mib << 20, args.chunks
    size = chunk * n
    print(f"host memory kinds on {torch.cuda.get_device_name(0)}: {n} x {args.mib} MiB; {thp_settings()}")
    print("| host memory | D2H GB/s | H2D GB/s | huge pages backing it |")
    print("|---|---|---|---|")
    device = torch.randint(0, 255, (size,), dtype=torch.uint8, device="cuda")

    def measure(label: str, host) -> None:
        def d2h() -> None:
            for i in range(n):
                host[i * chunk : (i + 1) * chunk].copy_(device[i * chunk : (i + 1) * chunk], non_blocking=True)
            torch.cuda.synchronize()

        def h2d() -> None:
            for i in range(n):
                device[i * chunk : (i + 1) * chunk].copy_(host[i * chunk : (i + 1) * chunk], non_blocking=True)
            torch.cuda.synchronize()

        down, up = gbps(size, timed(d2h, args.reps, 2)), gbps(size, timed(h2d, args.reps, 2))
        print(f"| {label} | {down.median:.1f} | {up.median:.1f} | {huge_kib(host.data_ptr()) or '—'} |")

    measure("cudaHostAlloc (pin_memory)", torch.empty(size, dtype=torch.uint8, pin_memory=True))
    for huge in (False, True):
        mm = mmap.mmap(-1, size)
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE)
        mm.madvise(MADV_POPULATE_WRITE)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        pin = runtime.pin(host.data_ptr(), size)
        measure(f"anonymous, registered{', MADV_HUGEPAGE' if huge else ''}" + ("" if pin.pinned else " (NOT pinned)"), host)
        pin.close()
        del host
        mm.close()
    for huge in (False, True):
        creator, user, path = shm_mapping(size, huge)
        host = torch.frombuffer(user, dtype=torch.uint8)
        pin = runtime.pin(host.data_ptr(), size)
        label = "/dev/shm file, MADV_HUGEPAGE before faulting" if huge else "/dev/shm file, posix_fallocate (the arena today)"
        measure(label + ", second mapping" + ("" if pin.pinned else " (NOT pinned)"), host)
        pin.close()
        del host
        user.close()
        creator.close()
        os.unlink(path)


if __name__ == "__main__":
    main()
