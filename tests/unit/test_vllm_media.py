"""Which chunks name which media items (``connectors/vllm/media.py``), and how ``chunk_hashes`` folds
what they name into the chain. No vLLM needed: a media item is read for its modality, identifier and
placeholder span only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvdepot.connectors.vllm.media import first_offset, media_extras
from kvdepot.hashing import chunk_hashes

CS = 16


def item(identifier: str, offset: int, length: int, modality: str = "image"):
    return SimpleNamespace(modality=modality, identifier=identifier, mm_position=SimpleNamespace(offset=offset, length=length))


def test_only_the_chunks_that_hold_an_items_placeholders_name_it():
    extras = media_extras([item("a", 20, 20)], 0, 4, CS)  # placeholders 20..39: chunks 1 and 2
    assert extras is not None
    assert extras[0] == b"" and extras[3] == b""
    assert extras[1] == extras[2] != b""
    assert media_extras([item("a", 20, 20)], 3, 5, CS) is None  # chunks 3 and 4: none of it
    assert media_extras([item("a", 20, 20)], 2, 3, CS) == [extras[2]]  # the same bytes, asked alone


def test_a_chunk_names_every_item_it_holds_in_placeholder_order():
    one = media_extras([item("a", 0, 4), item("b", 8, 4)], 0, 1, CS)
    other = media_extras([item("b", 8, 4), item("a", 0, 4)], 0, 1, CS)
    assert one == other  # vLLM's list order does not matter, the places do
    swapped = media_extras([item("b", 0, 4), item("a", 8, 4)], 0, 1, CS)
    assert one != swapped


@pytest.mark.parametrize(
    "changed",
    [item("a2", 20, 20), item("a", 21, 20), item("a", 20, 19), item("a", 20, 20, modality="audio")],
    ids=["identifier", "offset", "length", "modality"],
)
def test_whatever_places_or_names_an_item_changes_its_chunks_keys(changed):
    toks = list(range(100, 164))
    base = chunk_hashes(toks, CS, extras=media_extras([item("a", 20, 20)], 0, 4, CS))
    other = chunk_hashes(toks, CS, extras=media_extras([changed], 0, 4, CS))
    assert base[0] == other[0]  # before the item
    assert base[1] != other[1] and base[3] != other[3]  # the item's chunks, and everything after


def test_empty_extras_are_the_plain_chain_and_too_few_are_refused():
    toks = list(range(64))
    assert chunk_hashes(toks, CS, extras=[b""] * 4) == chunk_hashes(toks, CS)
    assert chunk_hashes(toks[CS:], CS, prefix=chunk_hashes(toks, CS)[0], extras=[b""] * 3) == chunk_hashes(toks, CS)[1:]
    with pytest.raises(ValueError, match="extras"):
        chunk_hashes(toks, CS, extras=[b""] * 3)


def test_first_offset_reads_the_items_added_since():
    items = [item("a", 50, 4), item("b", 10, 4), item("c", 90, 4)]
    assert first_offset(items) == 10
    assert first_offset(items, 2) == 90
    assert first_offset(items, 3) is None


def test_prompt_embedding_rows_name_their_chunks_and_none_past_them():
    import torch  # the engine's: installed with vLLM, which the suite needs

    from kvdepot.connectors.vllm.embeds import embeds_extras

    rows = torch.arange(40 * 4, dtype=torch.float32).reshape(40, 4)
    extras = embeds_extras(rows, None, 0, 4, CS)  # rows 0..39: chunks 0, 1 and half of 2
    assert extras is not None and extras[3] == b"" and len(set(extras[:3])) == 3
    assert embeds_extras(rows, None, 3, 5, CS) is None
    assert embeds_extras(rows.clone(), None, 1, 2, CS) == [extras[1]]
    assert embeds_extras(rows.to(torch.float64), None, 0, 1, CS) != extras[:1]
    mixed = embeds_extras(rows, [i % 2 == 0 for i in range(40)], 0, 1, CS)
    assert mixed != extras[:1]
