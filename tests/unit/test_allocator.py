"""ExtentAllocator: exact best-fit choices, coalescing, failure modes."""

from __future__ import annotations

import pytest

from kvdepot.storage.allocator import ExtentAllocator

U = 16  # alignment used throughout: sizes below are in multiples of it


def fill(alloc: ExtentAllocator, units: list[int]) -> list[int]:
    offsets = [alloc.allocate(u * U) for u in units]
    assert None not in offsets
    return offsets


def test_fresh_allocator_is_one_free_extent():
    a = ExtentAllocator(10 * U, alignment=U)
    s = a.stats()
    assert (s.capacity, s.used, s.free, s.largest_free, s.free_extents, s.allocations) == (160, 0, 160, 160, 1, 0)
    assert s.fragmentation == 0.0
    a.check_invariants()


def test_sequential_allocations_are_packed_from_the_base():
    a = ExtentAllocator(10 * U, alignment=U, base=4 * U)
    assert fill(a, [1, 2, 1]) == [64, 80, 112]
    assert a.stats().used == 4 * U
    a.check_invariants()


def test_sizes_round_up_to_alignment():
    a = ExtentAllocator(10 * U, alignment=U)
    assert a.allocate(1) == 0
    assert a.allocate(U + 1) == U
    assert a.allocate(U) == 3 * U
    assert [a.size_of(0), a.size_of(U), a.size_of(3 * U)] == [U, 2 * U, U]
    assert a.stats().used == 4 * U
    assert a.round_up(0) == 0 and a.round_up(1) == U and a.round_up(U) == U and a.round_up(U + 1) == 2 * U


def test_capacity_is_rounded_down_to_alignment():
    a = ExtentAllocator(10 * U + 5, alignment=U)
    assert a.capacity == 10 * U
    assert a.stats().largest_free == 10 * U


def test_best_fit_picks_the_smallest_fitting_extent():
    a = ExtentAllocator(12 * U, alignment=U)
    #                   a   b  c  d  e      tail: 4 units free at 8*U
    offs = fill(a, [1, 3, 1, 2, 1])
    assert offs == [0, 16, 64, 80, 112]
    a.free(16)  # 3-unit hole at 16
    a.free(80)  # 2-unit hole at 80
    assert a.stats().free_extents == 3
    assert a.allocate(2 * U) == 80  # exact fit beats the 3-unit hole and the 4-unit tail
    assert a.allocate(U) == 16  # 3-unit hole is now the smallest that fits
    assert a.allocate(3 * U) == 128  # the 2 units left at 32 are too small; the tail fits
    assert a.allocate(2 * U) == 32
    a.check_invariants()
    assert a.stats().free == U  # one unit left, at the very end
    assert a.allocate(U) == 176


def test_best_fit_ties_go_to_the_lowest_offset():
    a = ExtentAllocator(6 * U, alignment=U)
    fill(a, [1, 1, 1, 1, 1, 1])
    a.free(4 * U)
    a.free(2 * U)
    a.free(0)
    assert a.allocate(U) == 0
    assert a.allocate(U) == 2 * U
    assert a.allocate(U) == 4 * U


def test_allocate_returns_none_when_no_extent_is_large_enough_and_changes_nothing():
    a = ExtentAllocator(4 * U, alignment=U)
    fill(a, [1, 1, 1, 1])
    a.free(0)
    a.free(2 * U)  # 2 units free in total, but as two separate 1-unit holes
    before = a.stats()
    assert a.allocate(2 * U) is None
    assert a.can_allocate(2 * U) is False
    assert a.can_allocate(U) is True
    assert a.stats() == before
    a.check_invariants()


def test_allocate_when_full_returns_none():
    a = ExtentAllocator(2 * U, alignment=U)
    fill(a, [2])
    assert a.allocate(1) is None
    assert a.can_allocate(1) is False
    assert a.stats().largest_free == 0 and a.stats().fragmentation == 0.0


def test_zero_capacity_allocator():
    a = ExtentAllocator(U - 1, alignment=U)
    assert a.capacity == 0
    assert a.allocate(1) is None
    a.check_invariants()


def test_double_free_raises_key_error():
    a = ExtentAllocator(4 * U, alignment=U)
    off = a.allocate(U)
    a.free(off)
    with pytest.raises(KeyError):
        a.free(off)
    a.check_invariants()


def test_free_of_an_offset_that_is_not_an_allocation_start_raises_and_changes_nothing():
    a = ExtentAllocator(4 * U, alignment=U)
    a.allocate(2 * U)
    before = a.stats()
    with pytest.raises(KeyError):
        a.free(U)  # inside the allocation, not its start
    with pytest.raises(KeyError):
        a.free(3 * U)  # free space
    assert a.stats() == before


def test_freeing_coalesces_with_both_neighbours():
    a = ExtentAllocator(5 * U, alignment=U)
    offs = fill(a, [1, 1, 1, 1, 1])
    a.free(offs[1])
    a.free(offs[3])
    assert a.stats().free_extents == 2
    a.free(offs[2])  # joins the holes on both sides into one 3-unit extent
    s = a.stats()
    assert (s.free_extents, s.largest_free, s.free) == (1, 3 * U, 3 * U)
    assert a.allocate(3 * U) == offs[1]
    a.check_invariants()


def test_fragmentation_on_a_known_pattern():
    a = ExtentAllocator(8 * U, alignment=U)
    offs = fill(a, [1] * 8)
    for i in (0, 2, 3, 6):  # holes: [0] (1 unit), [2,3] (2 units, coalesced), [6] (1 unit)
        a.free(offs[i])
    s = a.stats()
    assert (s.free, s.largest_free, s.free_extents, s.allocations, s.used) == (64, 32, 3, 4, 64)
    assert s.fragmentation == pytest.approx(0.5)
    for i in (1, 4, 5, 7):
        a.free(offs[i])
    s = a.stats()
    assert (s.free_extents, s.largest_free, s.fragmentation) == (1, 8 * U, 0.0)


@pytest.mark.parametrize("alignment", [0, -16, 3, 24])
def test_alignment_must_be_a_power_of_two(alignment):
    with pytest.raises(ValueError):
        ExtentAllocator(1024, alignment=alignment)


def test_an_unaligned_base_gives_offsets_aligned_from_it():
    """Offsets are the base plus multiples of the alignment: the L1 starts its slots half a page in."""
    a = ExtentAllocator(8 * U, alignment=U, base=U + 8)
    offsets = [a.allocate(1), a.allocate(U + 1), a.allocate(U)]
    assert offsets == [U + 8, 2 * U + 8, 4 * U + 8]
    a.free(offsets[1])
    assert a.allocate(2 * U) == 2 * U + 8
    a.check_invariants()


def test_base_must_not_be_negative():
    with pytest.raises(ValueError):
        ExtentAllocator(1024, alignment=U, base=-8)


@pytest.mark.parametrize("size", [0, -1])
def test_non_positive_allocation_raises(size):
    a = ExtentAllocator(4 * U, alignment=U)
    with pytest.raises(ValueError):
        a.allocate(size)


def test_repr_shows_state():
    a = ExtentAllocator(4 * U, alignment=U)
    a.allocate(U)
    assert repr(a) == "ExtentAllocator(capacity=64, used=16, free_extents=1, fragmentation=0.000)"


def test_a_run_is_carved_side_by_side_from_the_best_fitting_extent():
    a = ExtentAllocator(20 * U, alignment=U)
    offs = fill(a, [1, 5, 1, 3, 1])  # holes to come at 16 (5 units) and 112 (3 units); tail 9 units at 176
    a.free(offs[1])
    a.free(offs[3])
    assert a.allocate_run(U + 1, 2) == [16, 48]  # 2 x 2 units: the 3-unit hole is too small, the 5-unit one fits best
    assert [a.size_of(16), a.size_of(48)] == [2 * U, 2 * U]
    a.check_invariants()
    assert a.allocate_run(U, 4) == [176, 192, 208, 224]  # 4 units: the 1- and 3-unit holes are too small; the tail
    a.check_invariants()
    assert a.allocate_run(U, 6) == []  # the tail has 5 units left: no extent holds 6 side by side
    assert a.allocate(3 * U) == 112  # one by one they still fit
    a.check_invariants()


def test_the_pieces_of_a_run_are_freed_one_by_one_and_coalesce():
    a = ExtentAllocator(8 * U, alignment=U)
    run = a.allocate_run(U, 4)
    assert run == [0, U, 2 * U, 3 * U] and a.stats().used == 4 * U and a.stats().allocations == 4
    assert [a.size_of(o) for o in run] == [U] * 4
    for o in (run[2], run[0], run[3], run[1]):
        a.free(o)
        a.check_invariants()
    s = a.stats()
    assert (s.used, s.free_extents, s.largest_free) == (0, 1, 8 * U)
    with pytest.raises(KeyError):
        a.free(run[0])


def test_a_run_no_extent_holds_changes_nothing():
    a = ExtentAllocator(8 * U, alignment=U)
    fill(a, [3])
    before = a.stats()
    assert a.allocate_run(U, 6) == []
    assert a.stats() == before
    a.check_invariants()
    with pytest.raises(ValueError):
        a.allocate_run(U, 0)
    with pytest.raises(ValueError):
        a.allocate_run(0, 2)
