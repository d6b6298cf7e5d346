"""ExtentAllocator under random allocate/free, checked against a model of the live allocations."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvdepot.storage.allocator import ExtentAllocator


class AllocatorMachine(RuleBasedStateMachine):
    allocations = Bundle("allocations")

    @initialize(
        alignment=st.sampled_from([1, 16, 4096]),
        units=st.integers(min_value=0, max_value=24),
        base_units=st.integers(min_value=0, max_value=3),
    )
    def setup(self, alignment, units, base_units):
        self.align = alignment
        self.base = base_units * alignment
        self.alloc = ExtentAllocator(units * alignment, alignment=alignment, base=self.base)
        self.cap = units * alignment
        self.live: dict[int, int] = {}  # offset -> rounded size
        self.handles: dict[int, int] = {}  # handle -> offset of a live allocation
        self.next_handle = 0

    def gaps(self) -> list[tuple[int, int]]:
        """The free extents the model implies: (size, offset), maximal (coalesced) by construction."""
        out, pos = [], self.base
        for off in sorted(self.live):
            if off > pos:
                out.append((off - pos, pos))
            pos = off + self.live[off]
        if pos < self.base + self.cap:
            out.append((self.base + self.cap - pos, pos))
        return out

    @rule(target=allocations, units=st.integers(min_value=1, max_value=6), extra=st.integers(min_value=0, max_value=1))
    def allocate(self, units, extra):
        size = units * self.align - (extra if self.align > 1 else 0)  # sometimes not a multiple
        need = units * self.align
        fitting = sorted(g for g in self.gaps() if g[0] >= need)
        off = self.alloc.allocate(size)
        if not fitting:
            assert off is None
            return None
        assert off == fitting[0][1], f"best fit should pick {fitting[0]}, got offset {off}"
        assert off % self.align == 0
        for o, s in self.live.items():
            assert off + need <= o or o + s <= off, "overlapping allocations"
        self.live[off] = need
        assert self.alloc.size_of(off) == need
        self.next_handle += 1
        self.handles[self.next_handle] = off
        return self.next_handle

    @rule(handle=consumes(allocations))
    def free(self, handle):
        off = self.handles.pop(handle, None)
        if off is None:  # allocation failed, or already freed by free_everything
            return
        self.alloc.free(off)
        del self.live[off]

    @rule()
    def free_everything_and_check_coalesced(self):
        for off in list(self.live):
            self.alloc.free(off)
        self.live.clear()
        self.handles.clear()
        s = self.alloc.stats()
        assert s.used == 0 and s.allocations == 0
        assert s.free_extents == (1 if self.cap else 0)
        assert s.largest_free == self.cap
        assert s.fragmentation == 0.0

    @invariant()
    def consistent(self):
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_invariants()
        s = self.alloc.stats()
        gaps = self.gaps()
        assert s.used == sum(self.live.values())
        assert s.free == self.cap - s.used
        assert s.allocations == len(self.live)
        assert s.free_extents == len(gaps)
        assert s.largest_free == max((g[0] for g in gaps), default=0)
        assert all(o % self.align == 0 for o in self.live)

    def teardown(self):
        if not hasattr(self, "alloc"):
            return
        for off in list(self.live):
            self.alloc.free(off)
        s = self.alloc.stats()
        assert s.free_extents == (1 if self.cap else 0)
        assert s.fragmentation == 0.0
        self.alloc.check_invariants()


AllocatorMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=50, deadline=None)
TestAllocator = AllocatorMachine.TestCase
