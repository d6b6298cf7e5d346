"""Payload framing: any agreed split reassembles to the object and passes check_payload."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.protocol.codec import check_payload, frame_sizes, rows_per_frame_for, split_object


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 12),
    row_bytes=st.integers(1, 64),
    max_frame=st.integers(1, 300),
    n_objects=st.integers(0, 3),
)
def test_split_reassembles_and_checks(rows, row_bytes, max_frame, n_objects):
    object_bytes = rows * row_bytes
    rpf = rows_per_frame_for(object_bytes, rows, max_frame)
    if row_bytes > max_frame:
        assert rpf == 0
    else:
        assert 1 <= rpf <= rows and rpf * row_bytes <= max_frame
        assert rpf == rows or (rpf + 1) * row_bytes > max_frame  # the largest grouping that fits
    objects = [bytes((i * 7 + j) % 256 for j in range(object_bytes)) for i in range(n_objects)]
    frames = [f for obj in objects for f in split_object(obj, rows, rpf, max_frame)]
    per = check_payload(frames, n_objects, object_bytes, rows, rpf, max_frame, request_id=1)
    sizes = frame_sizes(object_bytes, rows, rpf, max_frame)
    assert per == len(sizes)
    assert all(0 < s <= max_frame for s in sizes)
    if rpf:
        assert all(s % row_bytes == 0 for s in sizes)  # frames carry whole rows
    for i, obj in enumerate(objects):
        assert b"".join(bytes(f) for f in frames[i * per : (i + 1) * per]) == obj
