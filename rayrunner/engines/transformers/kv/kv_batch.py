"""A KV cache shared by the sequences of a running batch, which rows enter and leave between steps.

Rows are left-padded to a common length and carry an attention mask of their real tokens, so a new sequence's
prefilled cache joins by padding (never by recomputing anyone's keys and values) and a finished one leaves by
dropping its row. Columns that have become padding in every row are trimmed away. Every attention layer, sliding-
window ones included (Mistral, Gemma 2/3, gpt-oss, Cohere2...), is a plain `DynamicLayer` keeping every position:
transformers' sliding-window mask hides what is out of a layer's window (in cache positions, which left padding
shifts alike for a row's queries and keys), where its own sliding layers would drop old positions at different
points for different rows. It costs memory for positions out of the window (the KV budget counts them) and keeps
every sequence exact (`tests/families`). Models with other layer kinds (recurrent states, chunked attention) run one
sequence at a time (`mergeable` tells which).

transformers' cache appends by concatenating, which copies a layer's whole cache at every step: 16 rows of 1,000
SmolLM2 tokens are 368 MB copied per step (a third of the step). `append` (the fast decode step's) writes into room
reserved behind the cached positions instead (an eighth of the length more, at least `MIN_ROOM`: `kv_budget.grown`),
so a position is copied a few times over a generation rather than once per step; a layer whose tensors were replaced
since (a merge, a prefill through transformers) is moved into new room once. Attention reads the whole room, whose
unused positions are zeros: a view of only the cached positions would be copied by every matmul (its rows are not
evenly spaced), which costs what concatenating did. Decode steps of the fast step, this against concatenating (one
process, alternating): 16 rows of 1,000 tokens 1.30x (bf16), 16 rows of 100 1.02x, one row of 40 0.97-1.0x (Q8_0).

Rows leave and join in that room too. A finished row's place is taken by a row moved from the end
(`compacted_rows`: the scheduler keeps its running list in that order), so a leaving row costs one row's copy, not a
gather of every layer; its freed row at the end takes the next prompt whose prefill is not longer than the batch
(`merge`). Moved into new tensors instead: when most of the room would stand empty, when the kept rows share much
padding (which this trims), or when the joining prompt is longer. Figures: docs/performance.md ("Serving under load").
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin, get_layer_types_and_kwargs

from rayrunner.engines.transformers.kv.kv_budget import MIN_ROOM, grown

ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})  # layer kinds kept as plain `DynamicLayer`s
RECURRENT_LAYERS = frozenset({"linear_attention", "conv", "hybrid", "full_attention", "dummy"})  # hybrid models'


def new_cache(config: object) -> DynamicCache:
    """An empty cache for `config`'s model: a plain layer per attention layer, sliding-window ones included (see
    above), else transformers' own layers (recurrent states, chunked attention)."""
    if plain_attention(config):
        return DynamicCache()  # layers added as the forward fills them, each a `DynamicLayer`
    return DynamicCache(config=config)  # type: ignore[arg-type]


def hold(cache: DynamicCache, kv: torch.Tensor) -> None:
    """Make one row's `cache` hold `kv` [layers, 2, kv_heads, positions, head_dim]: each layer's keys and values are
    views of it (written in place by the prompt attention), as `update` would have left them by concatenating."""
    layers: list[Any] = cache.layers
    while len(layers) < kv.shape[0]:
        layers.append(DynamicLayer())
    for layer, (keys, values) in zip(layers, kv, strict=True):
        layer.keys, layer.values = keys[None], values[None]
        layer.device, layer.is_initialized = keys.device, True


def plain_attention(config: object) -> bool:
    """Whether every layer is attention, full or sliding-window: its cache is plain `DynamicLayer`s, one per layer
    (what the prefix cache copies blocks from and into)."""
    return set(_layer_types(config)) <= ATTENTION_LAYERS


def mergeable(config: object) -> bool:
    """Whether rows of this model's cache can be padded, joined and dropped: every layer is attention, full or
    sliding-window (the window is the mask's, from the config), or the model is a hybrid of full attention and
    recurrent layers (`recurrent`)."""
    kinds = set(_layer_types(config))
    return kinds <= ATTENTION_LAYERS or kinds <= RECURRENT_LAYERS


def recurrent(config: object) -> bool:
    """Whether some layers keep a recurrent state per row (Mamba, gated delta net, short convolutions: Qwen3-Next,
    LFM2, Falcon-H1, Granite 4, Jamba...): rows join and leave with their states, but a prompt is prefilled alone
    (left padding would run through the recurrence) and its start cannot be taken from cached blocks."""
    return bool(set(_layer_types(config)) - ATTENTION_LAYERS - {"dummy"})


class RowKV:
    """Copies of one row's keys and values, every layer's, for its real tokens `start` to `end` (after its left
    padding) [layers, 2, kv_heads, end - start, head_dim], asked for in increasing order (`PrefixCache.store`): the
    first ask gathers the layers from its `start` to the row's end in one copy, each ask copies its part of that."""

    def __init__(self, cache: BatchCache, row: int) -> None:
        self.cache, self.row = cache, row
        self.padding = cache.length - int(cache.mask[row].sum())
        self.first = 0  # the first real token `gathered` holds
        self.gathered: torch.Tensor | None = None

    def __call__(self, start: int, end: int) -> torch.Tensor:
        if self.gathered is None or start < self.first:
            begin = self.padding + start
            parts = [part for layer in _layers(self.cache.cache)
                     for part in (layer.keys[self.row, :, begin:], layer.values[self.row, :, begin:])]
            self.first, self.gathered = start, torch.stack(parts).unflatten(0, (-1, 2))
        return self.gathered[:, :, :, start - self.first: end - self.first].clone()


def merged(caches: list[BatchCache]) -> BatchCache:
    """The first of `caches` with the others' rows appended (`BatchCache.merge`), in order."""
    caches[0].merge(*caches[1:])
    return caches[0]


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window (None: it attends to every cached position)."""
    window = getattr(config.get_text_config(decoder=True), "sliding_window", None)
    return [window if kind == "sliding_attention" else None for kind in _layer_types(config)]


def _layer_types(config: Any) -> list[str]:
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    return list(layer_types)


class BatchCache:
    """The KV cache of a batch of sequences, with the mask of which cached positions are real tokens."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # [rows, length]: 1 for a real token, 0 for left padding
        self._room: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by layer: reserved keys and values
        self.max_positions: int | None = None  # most positions per row room may take (the KV budget's; None: any)

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def room_left(self) -> bool:
        """Whether the next step's `append` writes into room already held (else it allocates `kv_budget.grown`
        positions per row)."""
        room = self._room.get(0)
        layers = _layers(self.cache)
        return room is not None and bool(layers) and room[0].data_ptr() == layers[0].keys.data_ptr() \
            and room[0].shape[2] > self.length

    def row_kv(self, row: int) -> RowKV:
        """Row `row`'s keys and values, copied by spans of its real tokens (`RowKV`)."""
        return RowKV(self, row)

    def next_positions(self) -> torch.Tensor:
        """Each row's position for the token it feeds next: the count of its real cached tokens."""
        return self.mask.sum(dim=1, keepdim=True)

    def mask_with(self, new_tokens: int) -> torch.Tensor:
        """The attention mask for a forward pass that adds `new_tokens` real tokens to every row."""
        ones = torch.ones(self.rows, new_tokens, dtype=self.mask.dtype, device=self.mask.device)
        return torch.cat([self.mask, ones], dim=1)

    def grew(self, mask: torch.Tensor) -> None:
        """Record the mask of the forward pass that just appended to the cache."""
        self.mask = mask

    def append(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `keys`/`values` [rows, kv_heads, 1, head_dim] to layer `index` (in reserved room: see above);
        the layer's room for keys and values [rows, kv_heads, capacity, head_dim], zeros past the cached length."""
        room = self.reserve(index)
        length = _layers(self.cache)[index].keys.shape[2]
        room[0][:, :, length] = keys[:, :, 0]
        room[1][:, :, length] = values[:, :, 0]
        self.appended(index)
        return room

    def reserve(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s room for keys and values [rows, kv_heads, capacity, head_dim], with room for one more
        position past the cached ones (grown if it had none): where a step writes its keys and values before
        `appended`."""
        layer = _layers(self.cache)[index]
        rows, length = layer.keys.shape[0], layer.keys.shape[2]
        room = self._room.get(index)
        if room is None or room[0].shape[2] <= length or not _holds_layer(room, layer):
            capacity = grown(length, self.max_positions)
            room = self._room[index] = (_reserved(layer.keys, length, capacity),
                                        _reserved(layer.values, length, capacity))
        return room[0][:rows], room[1][:rows]  # rows left by `keep` stay free for the next `merge`

    def appended(self, index: int) -> None:
        """Layer `index` holds one more position: the one written into its room (`reserve`)."""
        layer = _layers(self.cache)[index]
        rows, length = layer.keys.shape[0], layer.keys.shape[2]
        keys, values = self._room[index]
        layer.keys, layer.values = keys[:rows, :, : length + 1], values[:rows, :, : length + 1]

    def merge(self, *others: BatchCache) -> None:
        """Append the rows of `others`, in order, left-padding the shorter ones: written into free rows of the room
        when it has them for all and none is longer; else every layer is copied once into new tensors."""
        if not others or self._merge_in_room(others):
            return  # nothing to append (a prompt prefilled alone), or written into the room
        caches = [self, *others]
        length = max(cache.length for cache in caches)
        for layers in zip(*(_any_layers(cache.cache) for cache in caches), strict=True):
            mine = layers[0]
            if _holds_kv(mine):
                mine.keys = _stacked([layer.keys for layer in layers], length)
                mine.values = _stacked([layer.values for layer in layers], length)
            for states in _states(*layers):
                for index in list(states[0]):
                    parts = [part for their_states in states if (part := their_states[index]) is not None]
                    if len(parts) == len(states):
                        states[0][index] = torch.cat(parts, dim=0)
        self.mask = _stacked([cache.mask for cache in caches], length)
        self._room.clear()  # the layers hold new tensors: the old room is let go now, not at the next append

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order). In room (`compacted_rows`' order, most rows kept, little shared
        padding): the rows moved from the end fill the places of those that left, and nothing else is copied; else
        every layer is gathered anew without the columns that are padding in all of the rows."""
        if self._keep_in_room(rows):
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        shared_padding = _shared_padding(self.mask)
        self.mask = self.mask[:, shared_padding:]
        for layer in _any_layers(self.cache):
            if _holds_kv(layer):
                layer.keys = layer.keys.index_select(0, index)[:, :, shared_padding:]
                layer.values = layer.values.index_select(0, index)[:, :, shared_padding:]
            for (states,) in _states(layer):
                for state_index, state in states.items():
                    if state is not None:
                        states[state_index] = state.index_select(0, index)
        self._room.clear()

    def _rooms(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every layer's room, when every layer is plain attention and holds its keys and values in its room."""
        layers = _any_layers(self.cache)
        rooms = [self._room.get(index) for index in range(len(layers))]
        if not layers or not all(_holds_kv(layer) and not _states(layer) and room is not None
                                 and _holds_layer(room, layer) for layer, room in zip(layers, rooms, strict=True)):
            return None
        return cast(list[tuple[torch.Tensor, torch.Tensor]], rooms)

    def _keep_in_room(self, rows: list[int]) -> bool:
        rooms = self._rooms()
        moves = [(place, row) for place, row in enumerate(rows) if row != place]
        if rooms is None or not rows or len(set(rows)) != len(rows) or any(row < len(rows) for _, row in moves):
            return False  # a row moved from below the kept ones would overwrite a row still to be read
        mask = self.mask[rows]
        if 2 * len(rows) < rooms[0][0].shape[0] or _shared_padding(mask) * 4 > max(self.length, 4 * MIN_ROOM):
            return False  # most of the room is free, or much padding is shared: gathering anew gives it back
        for keys, values in rooms:
            for place, row in moves:
                keys[place].copy_(keys[row])
                values[place].copy_(values[row])
        self._view_rooms(rooms, len(rows), self.length)
        self.mask = mask
        return True

    def _merge_in_room(self, others: tuple[BatchCache, ...]) -> bool:
        rooms, rows, length = self._rooms(), self.rows, self.length
        theirs = [_any_layers(other.cache) for other in others]
        end = rows + sum(other.rows for other in others)
        if rooms is None or end > rooms[0][0].shape[0] or any(other.length > length for other in others) \
                or any(len(layers) != len(rooms) or not all(_holds_kv(layer) for layer in layers)
                       for layers in theirs):
            return False
        for index, (keys, values) in enumerate(rooms):
            keys[rows:end].zero_()
            values[rows:end].zero_()
            row = rows
            for other, layers in zip(others, theirs, strict=True):
                start, below = length - other.length, row + other.rows
                keys[row:below, :, start:length].copy_(layers[index].keys)
                values[row:below, :, start:length].copy_(layers[index].values)
                row = below
        self._view_rooms(rooms, end, length)
        self.mask = torch.cat([self.mask, *(_pad_left(other.mask, length) for other in others)], dim=0)
        return True

    def _view_rooms(self, rooms: list[tuple[torch.Tensor, torch.Tensor]], rows: int, length: int) -> None:
        """Every layer's keys and values: the first `rows` rows and `length` positions of its room."""
        for layer, (keys, values) in zip(_layers(self.cache), rooms, strict=True):
            layer.keys, layer.values = keys[:rows, :, :length], values[:rows, :, :length]


def compacted_rows(done: list[bool]) -> list[int]:
    """The rows to keep of a batch whose rows `done` leave, in the order that moves the fewest: each place left
    below the kept count is taken by a kept row from the end (what `BatchCache.keep` does in room)."""
    count = done.count(False)
    order = list(range(count))
    holes = [place for place in range(count) if done[place]]
    movers = [row for row in range(count, len(done)) if not done[row]]
    for hole, mover in zip(holes, movers, strict=True):
        order[hole] = mover
    return order


def _holds_layer(room: tuple[torch.Tensor, torch.Tensor], layer: Any) -> bool:
    """Whether `layer`'s keys and values are views of `room`'s first rows (as `append` and `keep` leave them)."""
    return room[0].data_ptr() == layer.keys.data_ptr() and room[1].data_ptr() == layer.values.data_ptr() \
        and room[0].shape[1] == layer.keys.shape[1] and room[0].shape[0] >= layer.keys.shape[0]


def _shared_padding(mask: torch.Tensor) -> int:
    """Leading columns that are padding in every row of `mask`."""
    return int((mask.shape[1] - mask.sum(dim=1)).min()) if mask.shape[0] else 0


def _holds_kv(layer: Any) -> bool:
    """An attention layer (or a hybrid layer's attention part) holding keys and values."""
    return isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.numel() > 0


def _states(*layers: Any) -> list[tuple[dict[int, torch.Tensor | None], ...]]:
    """The recurrent layers' state dicts (conv and recurrent states by index, each [rows, ...]) of `layers`, side by
    side; none for an attention layer."""
    if not isinstance(layers[0], LinearAttentionCacheLayerMixin):
        return []
    return [tuple(getattr(layer, name) for layer in layers) for name in ("conv_states", "recurrent_states")]


def _any_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers of every kind (attention, recurrent, hybrid, placeholders)."""
    return list(cache.layers)


def _layers(cache: DynamicCache) -> list[_FilledLayer]:
    """The cache's layers, each already holding keys and values (a BatchCache exists only after a prefill)."""
    return cast(list[_FilledLayer], cache.layers)


class _FilledLayer(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def _reserved(cached: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
    """A tensor holding `cached`'s first `length` positions with room for more behind them."""
    shape = list(cached.shape)
    shape[2] = capacity
    room = cached.new_empty(shape)
    room[:, :, :length] = cached
    room[:, :, length:].zero_()  # attention reads the room past the cached positions: zeros, never stale values
    return room


def _stacked(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    """`tensors` one after another along their rows (dim 0), each zero-padded at the front of its sequence dimension
    (-2 for keys/values, -1 for a mask) to `length`: one copy of each, however many there are."""
    dim = 1 if tensors[0].dim() == 2 else 2
    shape = list(tensors[0].shape)
    shape[0], shape[dim] = sum(int(tensor.shape[0]) for tensor in tensors), length
    out = tensors[0].new_empty(shape)
    row = 0
    for tensor in tensors:
        rows, pad = int(tensor.shape[0]), length - int(tensor.shape[dim])
        out[row: row + rows].narrow(dim, 0, pad).zero_()
        out[row: row + rows].narrow(dim, pad, length - pad).copy_(tensor)
        row += rows
    return out


def _pad_left(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad `tensor` at the front of its sequence dimension (-2 for keys/values, -1 for a mask) to `length`."""
    if tensor.dim() == 2:
        return F.pad(tensor, (length - tensor.shape[1], 0))
    return F.pad(tensor, (0, 0, length - tensor.shape[-2], 0))
