"""kvlab's own cache designs, counterfactuals to transformers' (kvlab.caches), as transformers cache layers that the
model's own forward updates. Importing this module adds them to `kvlab.caches.make_cache` (`register`).

- list:     PR #30536's first design: chunks per layer, joined for attention, consolidated every `chunk_limit`. It
            teaches that a cache read by `torch.cat` copies the whole layer at every step all the same: the join is
            a transient copy beside the chunks.
- prealloc: ours: a buffer per layer that grows in blocks of `block_tokens`, written in place, read as a view;
            on a sliding-window layer, a window buffer of W - 1 + `block_tokens` slots (`WindowLayer`). It teaches
            what a cache without a per-step copy holds: the final KV rounded up to a block, and a copy of one
            layer's buffer only when it grows (or, on a sliding layer, when its window moves to the front).

Lessons 05 and later and the appendices use them (kvlab.planner.theory predicts them); the lab, the planner and
the command line import this module, so their users get both designs. Our layers keep the whole contract of
transformers' `CacheLayerMixin`.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from .caches import register
from .schema import DEFAULTS


class _OwnLayer(CacheLayerMixin):
    """What our layers share. Each defines `_each(fn)` (replace every stored tensor by `fn` of it, one at a time:
    the transient is one chunk or buffer, never the layer), `_keep(length)` and `tensors()`."""

    is_croppable = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype, self.is_initialized = key_states.device, key_states.dtype, True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1  # grows without a maximum

    def crop(self, tokens_to_remove: int) -> None:
        # As transformers 5.x's DynamicLayer.crop: minus the number of tokens to remove.
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes minus the number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove < 0 and self.get_seq_length() > 0:
            self._keep(max(0, self.get_seq_length() + tokens_to_remove))

    def reorder_cache(self, beam_idx) -> None:
        self._each(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._each(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._each(lambda tensor: tensor[indices, ...])

    def offload(self):
        self._each(lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.tensors() and self.tensors()[0].device != self.device:
            self._each(lambda tensor: tensor.to(self.device, non_blocking=True))


class _Joined:
    """`ListLayer.keys` / `.values`: the chunks joined at each read, not kept (a transient copy of the layer, as
    the concatenation `update` hands attention); setting one makes it the only chunk."""

    def __init__(self, chunks: str):
        self.chunks = chunks

    def __get__(self, layer, owner=None):
        if layer is None:
            return self
        chunks = getattr(layer, self.chunks)
        return torch.cat(chunks, dim=-2) if len(chunks) > 1 else chunks[0] if chunks else None

    def __set__(self, layer, tensor):
        setattr(layer, self.chunks, [] if tensor is None else [tensor])


class ListLayer(_OwnLayer):
    """`list`: chunks; attention gets their concatenation (a transient copy of the layer)."""

    keys, values = _Joined("key_chunks"), _Joined("value_chunks")

    def __init__(self, chunk_limit: int = DEFAULTS["chunk_limit"]):
        super().__init__()  # keys = values = None: no chunks
        self.chunk_limit = chunk_limit

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.key_chunks.append(key_states)
        self.value_chunks.append(value_states)
        if len(self.key_chunks) >= self.chunk_limit:  # consolidate: the list becomes one chunk
            self.key_chunks = [torch.cat(self.key_chunks, dim=-2)]
            self.value_chunks = [torch.cat(self.value_chunks, dim=-2)]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return sum(chunk.shape[-2] for chunk in self.key_chunks)

    def reset(self) -> None:
        self.keys = self.values = None

    def _keep(self, length: int) -> None:
        self.keys = self.keys[..., :length, :]
        self.values = self.values[..., :length, :]

    def _each(self, fn) -> None:
        for chunks in (self.key_chunks, self.value_chunks):
            for i, chunk in enumerate(chunks):
                chunks[i] = fn(chunk)

    def tensors(self):
        return self.key_chunks + self.value_chunks


class PreallocLayer(_OwnLayer):
    """`prealloc`: a buffer that grows in blocks; each step writes the new tokens in place and returns views."""

    def __init__(self, block_tokens: int = DEFAULTS["block_tokens"]):
        super().__init__()
        self.block_tokens = block_tokens
        self.key_buffer = self.value_buffer = None
        self.length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self.keys = self.values = None  # views of the old buffers would keep them alive
            self.key_buffer = self._grown(self.key_buffer, key_states, end)
            self.value_buffer = self._grown(self.value_buffer, value_states, end)
        self.key_buffer[:, :, start:end].copy_(key_states)
        self.value_buffer[:, :, start:end].copy_(value_states)
        self._keep(end)
        return self.keys, self.values

    def _grown(self, buffer, like, needed):
        """A buffer with room for `needed` tokens rounded up to a block; the old one dies on return."""
        capacity = math.ceil(needed / self.block_tokens) * self.block_tokens
        grown = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
        if buffer is not None:
            grown[:, :, : self.length].copy_(buffer[:, :, : self.length])
        return grown

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self._keep(0)  # the buffers stay, to be written again

    def _keep(self, length: int) -> None:
        self.length = length
        self._views()

    def _views(self) -> None:
        if self.key_buffer is not None:
            self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]

    def _each(self, fn) -> None:
        if self.key_buffer is not None:
            self.keys = self.values = None  # views of the old buffers would keep them alive
            self.key_buffer = fn(self.key_buffer)
            self.value_buffer = fn(self.value_buffer)
            self._views()

    def tensors(self):
        return [t for t in (self.key_buffer, self.value_buffer) if t is not None]


class WindowLayer(PreallocLayer):
    """`prealloc` on a sliding layer of window W: the last W - 1 tokens (all a later query sees, what transformers'
    `DynamicSlidingWindowLayer` keeps), in order, in a buffer of W - 1 + `block_tokens` slots, written in place.
    When the buffer is full the window moves to its front: one copy every `block_tokens` steps, where
    transformers' layer cats every step. Of a prompt longer than the buffer only the last W - 1 tokens are kept.

    Why not a ring of W slots: attention would get the window rotated, and 5.24's masks index the padding mask by
    position in the keys (`masking_utils.padding_mask_function`): a left-padded batch would mask the wrong keys
    (a left-padded test in test_cache_contract.py pins the order)."""

    is_sliding = True

    def __init__(self, sliding_window: int, block_tokens: int = DEFAULTS["block_tokens"]):
        super().__init__(block_tokens)
        self.sliding_window = sliding_window
        self.start = self.end = 0  # buffer[start:end]: the kept tokens, oldest first
        self.cumulative_length = 0  # tokens seen, as transformers' layer counts them

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new, capacity = key_states.shape[-2], self.sliding_window - 1 + self.block_tokens
        self.cumulative_length += new
        if self.key_buffer is None:
            self.key_buffer = key_states.new_empty((*key_states.shape[:-2], capacity, key_states.shape[-1]))
            self.value_buffer = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
        if self.end + new > capacity and self.start > 0:  # move the window to the front, to make room
            kept = self.end - self.start
            for buffer in (self.key_buffer, self.value_buffer):  # clone: source and target may overlap
                buffer[:, :, :kept].copy_(buffer[:, :, self.start : self.end].clone())
            self.start, self.end = 0, kept
        if self.end + new <= capacity:
            self.key_buffer[:, :, self.end : self.end + new].copy_(key_states)
            self.value_buffer[:, :, self.end : self.end + new].copy_(value_states)
            self.end += new
            keys, values = self.key_buffer[:, :, self.start : self.end], self.value_buffer[:, :, self.start : self.end]
        else:  # more tokens than the buffer holds: attention reads them joined, as transformers' layer does
            keys, values = key_states, value_states
            if self.end > self.start:
                keys = torch.cat([self.key_buffer[:, :, self.start : self.end], key_states], dim=-2)
                values = torch.cat([self.value_buffer[:, :, self.start : self.end], value_states], dim=-2)
            tail = min(self.sliding_window - 1, keys.shape[-2])
            self.key_buffer[:, :, :tail].copy_(keys[:, :, keys.shape[-2] - tail :])
            self.value_buffer[:, :, :tail].copy_(values[:, :, values.shape[-2] - tail :])
            self.start, self.end = 0, tail
        self.start = max(self.start, self.end - (self.sliding_window - 1))  # what no later query can see
        self._views()
        return keys, values

    def _views(self) -> None:
        if self.key_buffer is not None:
            self.keys = self.key_buffer[:, :, self.start : self.end]
            self.values = self.value_buffer[:, :, self.start : self.end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return DynamicSlidingWindowLayer.get_mask_sizes(self, query_length)  # the same counts, the same formula

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        # As transformers' layer without past recording: tokens that left the window cannot come back.
        if tokens_to_remove < 0 and self.cumulative_length >= self.sliding_window:
            raise RuntimeError("crop past the sliding window: the tokens before it are no longer kept")
        super().crop(tokens_to_remove)

    def _keep(self, length: int) -> None:  # only below the window (crop), where start is 0
        self.start, self.end = 0, length
        self.cumulative_length = length
        self._views()


register("list", lambda window, options: ListLayer(options["chunk_limit"]))
register(
    "prealloc",
    lambda window, options: (
        WindowLayer(window, options["block_tokens"]) if window else PreallocLayer(options["block_tokens"])
    ),
)
