"""The KV cache layers of the rollout engine's decoding (``fastalign.sampling.generation``).

Why not transformers' ``DynamicLayer`` as is: it concatenates at every decode step, copying the whole
cache each time (at 256 completion tokens that copy outweighs the step's weights on a CPU), and it holds a
prompt's keys and values once per row that samples from it. ``ReservedLayer`` appends in place into a
buffer sized for the completion; ``SharedPrefixLayer`` also holds each prompt once for its rows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A full-attention cache layer that appends in place: ``DynamicLayer`` concatenates, copying the
    whole cache at every decode step (at 256 completion tokens that copy outweighs the step's weights).
    ``reserve`` moves the cache into a buffer with room for ``tokens`` more, and ``update`` then writes
    each step's keys and values after the filled part and returns views of it."""

    def reserve(self, tokens: int) -> None:
        length = self.get_seq_length()
        self._keys = self.keys.new_empty(*self.keys.shape[:-2], length + tokens, self.keys.shape[-1])
        self._values = self.values.new_empty(*self.values.shape[:-2], length + tokens, self.values.shape[-1])
        self._keys[..., :length, :] = self.keys
        self._values[..., :length, :] = self.values
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

    #: Where a fixed-shape step writes (a device tensor, ``make_static``); None: after the filled part.
    position: torch.Tensor | None = None

    def make_static(self, position: torch.Tensor, length: int) -> None:
        """Fixed-shape steps from now on (``fastalign.sampling.decode_steps``): ``update`` writes at
        ``position`` and returns the whole reserved buffer, which the step's mask limits to the filled part.
        The unfilled tail is zeroed: a masked score's weight is 0, but 0 times a NaN left in memory is NaN.
        ``length`` (the positions filled, host side) is what ``get_seq_length`` answers, and a read of it
        is noted (``length_read``): a captured step would replay the length it read."""
        self._keys[..., length:, :].zero_()
        self._values[..., length:, :].zero_()
        self.position, self.length, self.length_read = position, length, False

    def make_dynamic(self, length: int) -> None:
        """Back to appending after the first ``length`` positions (from fixed-shape steps)."""
        self.position = None
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]

    def get_seq_length(self) -> int:
        if self.position is None:
            return super().get_seq_length()
        self.length_read = True
        return self.length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not hasattr(self, "_keys"):
            return super().update(key_states, value_states, *args, **kwargs)
        if self.position is not None:
            self._keys.index_copy_(-2, self.position, key_states)
            self._values.index_copy_(-2, self.position, value_states)
            return self._keys, self._values
        start, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not hasattr(self, "_keys"):
            return super().batch_select_indices(indices)
        length = self.keys.shape[-2]
        self._keys, self._values = self._keys[indices], self._values[indices]
        self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]


class SharedPrefixLayer(ReservedLayer):
    """A full-attention cache layer holding its prompts once after ``share`` (``prefix_keys`` and
    ``prefix_values``, [B, H, P, D]), each row's own decoded keys and values appended in place after them
    (``keys``/``values``, [R, H, T, D]); before ``share``, a ``DynamicLayer``. The attention that reads
    both is ``fastalign.sampling.prefix_attention``'s."""

    shared = False

    def share(self, group: int, prompt_mask: torch.Tensor, tokens: int) -> None:
        """Keep the prefilled prompts' keys and values once for ``group`` rows each, with room for
        ``tokens`` decoded ones per row. ``prompt_mask``: the prompts' [B, P] attention mask. Half-precision
        prefixes are kept in fp32, which the shared attention sums in (as sdpa's kernels accumulate):
        twice their bytes, still ``group / 2`` times less than repeating them, and no copy per step."""
        half = self.keys.dtype in (torch.bfloat16, torch.float16)
        self.prefix_keys = self.keys.float() if half else self.keys
        self.prefix_values = self.values.float() if half else self.values
        self.prefix_mask = prompt_mask.bool()[:, None, None, :]  # [B, 1, 1, P]
        batch, heads = self.keys.shape[:2]
        self.keys = self.keys.new_empty(batch * group, heads, 0, self.keys.shape[-1])
        self.values = self.values.new_empty(batch * group, self.values.shape[1], 0, self.values.shape[-1])
        self.reserve(tokens)  # the rows' own
        self._place(torch.arange(batch, device=self.keys.device).repeat_interleave(group))
        self.shared = True

    def _place(self, prompt_of_row: torch.Tensor) -> None:
        """Each row's prompt, and its slot among that prompt's rows (rows are grouped by prompt)."""
        self.prompt_of_row = prompt_of_row
        counts = torch.bincount(prompt_of_row, minlength=self.prefix_keys.shape[0])
        starts = counts.cumsum(0) - counts
        self.slot_of_row = (
            torch.arange(len(prompt_of_row), device=prompt_of_row.device) - starts[prompt_of_row]
        )
        self.slots = int(counts.max()) if len(prompt_of_row) else 0  # one host sync per compaction

    def get_seq_length(self) -> int:
        own = super().get_seq_length()
        return own + self.prefix_keys.shape[-2] if self.shared else own

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.shared:
            self._place(self.prompt_of_row[indices])

    def full(self, own: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """The repeated cache's tensor: each row's prompt's prefix, then its own (in its dtype)."""
        return torch.cat([prefix[self.prompt_of_row].to(own.dtype), own], dim=-2)
