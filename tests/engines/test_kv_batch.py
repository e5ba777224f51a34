"""`BatchCache.append`: positions written into reserved room hold what concatenating would, across merges and
dropped rows, the room past them is zeros, and a long generation reallocates only a few times."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from rayrunner.engines.transformers.kv.kv_batch import BatchCache, compacted_rows, new_cache

CONFIG = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _filled(rows: int, length: int, seed: int) -> BatchCache:
    """A batch whose layers hold `length` random positions per row (as a prefill leaves them)."""
    generator = torch.Generator().manual_seed(seed)
    batch = BatchCache(new_cache(CONFIG), torch.ones((rows, length), dtype=torch.long))
    for layer in range(CONFIG.num_hidden_layers):
        keys, values = (torch.randn(rows, 2, length, 8, generator=generator) for _ in range(2))
        batch.cache.update(keys, values, layer)
    return batch


def _check(batch: BatchCache, layer: int, room: tuple[torch.Tensor, torch.Tensor],
           want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The layer's cache is `want`, and `room` holds it followed by zeros."""
    cached = batch.cache.layers[layer]
    length = want[0].shape[2]
    for mine, theirs, reserved in ((cached.keys, want[0], room[0]), (cached.values, want[1], room[1])):
        assert torch.equal(mine, theirs)
        assert torch.equal(reserved[:, :, :length], theirs) and not reserved[:, :, length:].any()


def _position(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, 1, 8, generator=generator), torch.randn(rows, 2, 1, 8, generator=generator)


def test_appends_hold_what_concatenating_holds_with_few_reallocations() -> None:
    batch, twin = _filled(3, 5, seed=0), _filled(3, 5, seed=0)
    places = set()
    for step in range(200):
        keys, values = _position(3, seed=step)
        for layer in range(CONFIG.num_hidden_layers):
            room = batch.append(layer, keys, values)
            _check(batch, layer, room, twin.cache.update(keys, values, layer))
        places.add(batch.cache.layers[0].keys.data_ptr())
    assert len(places) <= 20  # room grows by an eighth: 205 positions in a handful of tensors, not 200


def test_appends_after_a_merge_and_a_dropped_row() -> None:
    batch, twin = _filled(2, 4, seed=1), _filled(2, 4, seed=1)
    for step in range(3):
        keys, values = _position(2, seed=10 + step)
        batch.append(0, keys, values)
        twin.cache.update(keys, values, 0)
        batch.append(1, keys, values)
        twin.cache.update(keys, values, 1)
    batch.grew(batch.mask_with(3))
    twin.grew(twin.mask_with(3))
    batch.merge(_filled(1, 2, seed=2))  # a shorter row joins: padded on the left
    twin.merge(_filled(1, 2, seed=2))
    batch.keep([0, 2])
    twin.keep([0, 2])
    keys, values = _position(2, seed=99)
    for layer in range(CONFIG.num_hidden_layers):
        room = batch.append(layer, keys, values)
        _check(batch, layer, room, twin.cache.update(keys, values, layer))


def _stepped(batch: BatchCache, twin: BatchCache, steps: int, seed: int) -> None:
    """`steps` decode steps appended to `batch` (into room) and concatenated onto `twin`."""
    for step in range(steps):
        keys, values = _position(batch.rows, seed=seed + step)
        for layer in range(CONFIG.num_hidden_layers):
            batch.append(layer, keys, values)
            twin.cache.update(keys, values, layer)
        batch.grew(batch.mask_with(1))
        twin.grew(twin.mask_with(1))


def _same(batch: BatchCache, twin: BatchCache) -> None:
    assert torch.equal(batch.mask, twin.mask)
    for mine, theirs in zip(batch.cache.layers, twin.cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_compacted_rows_fill_the_places_of_finished_rows_from_the_end() -> None:
    assert compacted_rows([False, True, False, False]) == [0, 3, 2]
    assert compacted_rows([True, True, False, False, False]) == [3, 4, 2]
    assert compacted_rows([False, False, True]) == [0, 1]
    assert compacted_rows([True]) == []


def test_rows_leave_and_join_in_room_without_reallocating() -> None:
    batch, twin = _filled(4, 5, seed=3), _filled(4, 5, seed=3)
    _stepped(batch, twin, 2, seed=20)
    place = batch.cache.layers[0].keys.data_ptr()
    keep = compacted_rows([False, True, False, False])
    batch.keep(keep)
    twin.keep(keep)
    _same(batch, twin)
    assert batch.cache.layers[0].keys.data_ptr() == place and batch.room_left()
    batch.merge(_filled(1, 3, seed=4))  # a shorter prompt takes the free row, padded on the left
    twin.merge(_filled(1, 3, seed=4))
    _same(batch, twin)
    assert batch.cache.layers[0].keys.data_ptr() == place
    _stepped(batch, twin, 3, seed=40)
    _same(batch, twin)
    keys, values = _position(4, seed=77)
    for layer in range(CONFIG.num_hidden_layers):
        room = batch.append(layer, keys, values)
        _check(batch, layer, room, twin.cache.update(keys, values, layer))


def test_several_prompts_join_free_rows_of_the_room_at_once() -> None:
    batch, twin = _filled(5, 6, seed=8), _filled(5, 6, seed=8)
    _stepped(batch, twin, 2, seed=30)
    keep = compacted_rows([False, True, False, True, False])
    batch.keep(keep)
    twin.keep(keep)
    place = batch.cache.layers[0].keys.data_ptr()
    batch.merge(_filled(1, 4, seed=9), _filled(1, 8, seed=10))  # two prompts take the two free rows, in order
    for other in (_filled(1, 4, seed=9), _filled(1, 8, seed=10)):
        twin.merge(other)
    _same(batch, twin)
    assert batch.cache.layers[0].keys.data_ptr() == place and batch.rows == 5
    _stepped(batch, twin, 2, seed=50)
    _same(batch, twin)


def test_a_batch_mostly_gone_or_a_longer_prompt_moves_into_new_tensors() -> None:
    batch, twin = _filled(4, 5, seed=5), _filled(4, 5, seed=5)
    _stepped(batch, twin, 1, seed=60)
    batch.merge(_filled(1, 9, seed=6))  # longer than the batch: every row is padded, so every layer is gathered
    twin.merge(_filled(1, 9, seed=6))
    _same(batch, twin)
    _stepped(batch, twin, 1, seed=61)
    place = batch.cache.layers[0].keys.data_ptr()
    batch.keep([4])  # one row of five: the room would hold four free rows
    twin.keep([4])
    _same(batch, twin)
    assert batch.cache.layers[0].keys.data_ptr() != place and batch.cache.layers[0].keys.shape[0] == 1


def test_caches_merged_at_once_hold_what_merging_them_one_by_one_holds() -> None:
    """Prompts prefilled side by side join in one copy of each (`merge(*others)`), padded on the left as `merge`
    pads one."""
    sizes = [(2, 5), (1, 3), (3, 7), (1, 1)]
    at_once, one_by_one = ([_filled(rows, length, seed) for seed, (rows, length) in enumerate(sizes)] for _ in "ab")
    at_once[0].merge(*at_once[1:])
    for other in one_by_one[1:]:
        one_by_one[0].merge(other)
    assert torch.equal(at_once[0].mask, one_by_one[0].mask) and at_once[0].mask.shape == (7, 7)
    for mine, theirs in zip(at_once[0].cache.layers, one_by_one[0].cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_a_rows_kv_is_copied_from_after_its_padding() -> None:
    """`row_kv(row)(start, end)`: every layer's keys and values of the row's real tokens start to end, stacked, in
    storage of their own (a block kept in the prefix cache holds only its bytes)."""
    batch = _filled(1, 6, seed=3)
    batch.merge(_filled(1, 9, seed=4))  # row 0 now has 3 positions of left padding
    kv = batch.row_kv(0)
    first, second = kv(1, 3), kv(3, 6)
    layers = batch.cache.layers
    for start, end, got in ((1, 3, first), (3, 6, second)):
        want = torch.stack([torch.stack([layer.keys[0, :, 3 + start: 3 + end], layer.values[0, :, 3 + start: 3 + end]])
                            for layer in layers])
        assert torch.equal(got, want) and got.is_contiguous() and got.untyped_storage().nbytes() == got.nbytes
    assert torch.equal(kv(0, 2)[:, :, :, 1:], first[:, :, :, :1])  # an earlier start gathers again
