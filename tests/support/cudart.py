"""A fake of CUDA's host registration (``cudaHostRegister``/``cudaHostUnregister``) for CPU tests of
the pinned-memory paths: it behaves as the runtime does where the tests look."""

from __future__ import annotations


class FakeCudart:
    """A range registered twice, or overlapping another registration, is refused (712); unregistering
    what is not registered is refused (713). Every call is appended to ``calls`` (pass a list shared
    with other fakes, e.g. an arena's unmaps, to see the order)."""

    def __init__(self, calls: list[str] | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[str] = [] if calls is None else calls

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append("register")
        if any(a < address + size and address < a + s for a, s in self.registered.items()):
            return 712
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append("unregister")
        return 0 if self.registered.pop(address, None) is not None else 713
