"""Variable-length sequences for the recurrent layers, with torch.nn.utils.rnn's names and layout.

A PackedSequence holds a batch of sequences of different lengths time step by time step: `data` is every
sequence's step 0, then every step 1 of the sequences that long, and so on, the sequences in order of decreasing
length; `batch_sizes[t]` counts the sequences still running at step t. The lengths are host values (they decide
shapes), so packing and unpacking are each one gather whose positions are computed on the host; their gradients
are the gather's. RNN, LSTM and GRU run a PackedSequence step by step over only the sequences still running.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence

import numpy as np

from ember import dtypes
from ember.errors import ShapeError, operands
from ember.ops.creation import full, tensor
from ember.ops.index import select_in_range
from ember.ops.movement import cat, pad_axis, reshape, stack
from ember.tensor import Tensor, expect_tensors

__all__ = ["PackedSequence", "invert_permutation", "pack_padded_sequence", "pack_sequence", "pad_packed_sequence",
           "pad_sequence", "unpack_sequence", "unpad_sequence"]


class PackedSequence(namedtuple("PackedSequence", ["data", "batch_sizes", "sorted_indices", "unsorted_indices"])):
    """torch.nn.utils.rnn.PackedSequence: `data` (sum of the lengths, *), `batch_sizes` (an int64 tensor on the
    cpu, one count per step), and, when the batch was sorted by length, `sorted_indices` (the batch positions in
    packing order) and `unsorted_indices` (its inverse, computed when not given), else None."""

    __slots__ = ()

    def __new__(cls, data: Tensor, batch_sizes: Tensor, sorted_indices: Tensor | None = None,
                unsorted_indices: Tensor | None = None) -> PackedSequence:
        if unsorted_indices is None:
            unsorted_indices = invert_permutation(sorted_indices)
        return super().__new__(cls, data, batch_sizes, sorted_indices, unsorted_indices)

    def to(self, *args, **kwargs) -> PackedSequence:
        """The data moved or cast as Tensor.to does; the step counts stay on the cpu, as torch keeps them."""
        data = self.data.to(*args, **kwargs)
        if data is self.data:
            return self
        move = (lambda t: None if t is None else t.to(data.device))
        return PackedSequence(data, self.batch_sizes, move(self.sorted_indices), move(self.unsorted_indices))

    @property
    def is_cuda(self) -> bool:
        return self.data.device.type == "cuda"


def host_ints(name: str, values) -> np.ndarray:
    """`values` (a list, NumPy array, or an ember or torch tensor) as a 1-d int64 array on the host."""
    if hasattr(values, "detach"):  # a torch tensor
        values = values.detach().cpu().numpy()
    elif isinstance(values, Tensor):
        values = values.numpy()
    array = np.asarray(values)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ShapeError(f"{name} must be a 1-d sequence of integers, got {values!r}")
    return array.astype(np.int64)


def _indices(values: np.ndarray, device) -> Tensor:
    return tensor(values.astype(np.int64), dtype=dtypes.int64, device=device)


def invert_permutation(permutation: Tensor | None) -> Tensor | None:
    """The inverse of a permutation of batch positions (None for None), as torch's."""
    if permutation is None:
        return None
    order = host_ints("permutation", permutation)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return _indices(inverse, permutation.device)


def step_starts(batch_sizes: np.ndarray) -> np.ndarray:
    """Where each step's rows start in a PackedSequence's data."""
    return np.concatenate([[0], np.cumsum(batch_sizes)[:-1]]).astype(np.int64)


def batch_sizes_of(packed: PackedSequence) -> np.ndarray:
    """A PackedSequence's step counts on the host, checked to describe its data."""
    counts = host_ints("PackedSequence.batch_sizes", packed.batch_sizes)
    if counts.size == 0 or counts.min() <= 0 or np.any(np.diff(counts) > 0) or counts.sum() != packed.data.shape[0]:
        raise ShapeError(f"PackedSequence: batch_sizes {counts.tolist()} must be positive, non-increasing counts "
                         f"summing to the data's first dim, got data of shape {packed.data.shape}")
    return counts


def pack_padded_sequence(input: Tensor, lengths, batch_first: bool = False,
                         enforce_sorted: bool = True) -> PackedSequence:
    """Pack a padded batch (T, B, *) ((B, T, *) with `batch_first`) of sequences of the given `lengths` (host
    integers: a list, or an int64 tensor). With `enforce_sorted` the lengths must decrease; without it the batch is
    packed in order of decreasing length (ties in batch order), recorded in `sorted_indices`."""
    expect_tensors("pack_padded_sequence", input=input)
    lengths = host_ints("pack_padded_sequence: lengths", lengths)
    if input.ndim < 2:
        raise ShapeError(f"pack_padded_sequence: expected input of at least 2 dims (T, B, *), got {operands(input)}")
    time, batch = (input.shape[1], input.shape[0]) if batch_first else input.shape[:2]
    if lengths.size != batch:
        raise ShapeError(f"pack_padded_sequence: expected {batch} lengths, one per sequence of the batch of input "
                         f"{input.shape}{' (batch_first)' if batch_first else ''}, got {lengths.size}")
    if lengths.size and lengths.min() <= 0:
        raise ValueError(f"pack_padded_sequence: every length must be greater than 0, got {lengths.tolist()}")
    if lengths.size and lengths.max() > time:
        raise ShapeError(f"pack_padded_sequence: lengths {lengths.tolist()} run past the {time} steps of input "
                         f"{input.shape}")
    if enforce_sorted:
        if np.any(np.diff(lengths) > 0):
            raise ValueError(f"pack_padded_sequence: lengths {lengths.tolist()} must be sorted in decreasing order "
                             "when enforce_sorted is True; pass enforce_sorted=False to pack unsorted sequences")
        order, sorted_indices = np.arange(batch), None
    else:
        order = np.argsort(-lengths, kind="stable")
        sorted_indices = _indices(order, input.device)
    ordered = lengths[order]
    batch_sizes = np.array([(ordered > t).sum() for t in range(int(ordered.max(initial=0)))], dtype=np.int64)
    if batch_sizes.size == 0:
        raise ValueError("pack_padded_sequence: cannot pack an empty batch")
    # the position in input, flattened over (T, B) or (B, T), of each packed row: step t of sequence order[j]
    rows = np.concatenate([order[:n] * time + t if batch_first else t * batch + order[:n]
                           for t, n in enumerate(batch_sizes)])
    flat = reshape(input, (time * batch, *input.shape[2:]))
    data = select_in_range(flat, 0, _indices(rows, input.device))
    return PackedSequence(data, tensor(batch_sizes, dtype=dtypes.int64, device="cpu"), sorted_indices)


def pad_packed_sequence(sequence: PackedSequence, batch_first: bool = False, padding_value: float = 0.0,
                        total_length: int | None = None) -> tuple[Tensor, Tensor]:
    """The inverse of pack_padded_sequence: the padded batch (T, B, *) ((B, T, *) with `batch_first`), the steps
    past each sequence's end `padding_value`, T the longest length or `total_length`, and the lengths (an int64
    tensor on the cpu) in the batch's own order."""
    if not isinstance(sequence, PackedSequence):
        raise TypeError(f"pad_packed_sequence: expected a PackedSequence, got {type(sequence).__name__}")
    data = sequence.data
    counts = batch_sizes_of(sequence)
    time, batch = counts.size, int(counts[0])
    if total_length is not None:
        if total_length < time:
            raise ValueError(f"pad_packed_sequence: total_length {total_length} is shorter than the longest sequence "
                             f"of the batch ({time} steps)")
        time = total_length
    order = (host_ints("PackedSequence.sorted_indices", sequence.sorted_indices)
             if sequence.sorted_indices is not None else np.arange(batch))
    sorted_lengths = np.array([(counts > j).sum() for j in range(batch)], dtype=np.int64)
    # each padded position's row in data, or the padding row past the data's end
    source = np.full((time, batch), data.shape[0], dtype=np.int64)
    starts = step_starts(counts)
    for t, n in enumerate(counts):
        source[t, order[:n]] = starts[t] + np.arange(n)
    if batch_first:
        source = source.T
    padding = full((1, *data.shape[1:]), padding_value, dtype=data.dtype, device=data.device)
    rows = select_in_range(cat([data, padding]), 0, _indices(source.reshape(-1), data.device))
    lengths = np.empty(batch, dtype=np.int64)
    lengths[order] = sorted_lengths
    return reshape(rows, (*source.shape, *data.shape[1:])), tensor(lengths, dtype=dtypes.int64, device="cpu")


def pad_sequence(sequences: Sequence[Tensor], batch_first: bool = False, padding_value: float = 0.0,
                 padding_side: str = "right") -> Tensor:
    """Stack sequences of shape (L_i, *) into (T, B, *) ((B, T, *) with `batch_first`), T the longest, each padded
    with `padding_value` after its end (before its start with padding_side='left')."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"pad_sequence: padding_side must be 'left' or 'right', not {padding_side!r}")
    if isinstance(sequences, Tensor):
        sequences = list(sequences.unbind(0))
    sequences = list(sequences)
    if not sequences:
        raise ValueError("pad_sequence: received an empty list of sequences")
    expect_tensors("pad_sequence", **{f"sequences[{i}]": s for i, s in enumerate(sequences)})
    trailing = sequences[0].shape[1:]
    if any(s.ndim == 0 or s.shape[1:] != trailing for s in sequences):
        raise ShapeError(f"pad_sequence: every sequence must be (L, *{trailing}), got {operands(*sequences)}")
    longest = max(s.shape[0] for s in sequences)
    padded = [_padded(s, longest, padding_value, padding_side) for s in sequences]
    return stack(padded, 0 if batch_first else 1)


def _padded(sequence: Tensor, length: int, value: float, side: str) -> Tensor:
    extra = length - sequence.shape[0]
    if not extra:
        return sequence
    if value == 0:
        return pad_axis(sequence, 0, extra if side == "left" else 0, extra if side == "right" else 0)
    fill = full((extra, *sequence.shape[1:]), value, dtype=sequence.dtype, device=sequence.device)
    return cat([fill, sequence] if side == "left" else [sequence, fill])


def pack_sequence(sequences: Sequence[Tensor], enforce_sorted: bool = True) -> PackedSequence:
    """Pack a list of sequences (L_i, *): pad_sequence, then pack_padded_sequence of their lengths."""
    sequences = list(sequences)
    lengths = [s.shape[0] if isinstance(s, Tensor) and s.ndim else 0 for s in sequences]
    return pack_padded_sequence(pad_sequence(sequences), lengths, enforce_sorted=enforce_sorted)


def unpad_sequence(padded_sequences: Tensor, lengths, batch_first: bool = False) -> list[Tensor]:
    """The inverse of pad_sequence: each sequence of the padded batch cut to its length."""
    lengths = host_ints("unpad_sequence: lengths", lengths)
    batch = padded_sequences.unbind(0 if batch_first else 1)
    if len(batch) != lengths.size:
        raise ShapeError(f"unpad_sequence: expected {len(batch)} lengths, got {lengths.size}")
    return [s[:n] for s, n in zip(batch, lengths.tolist())]


def unpack_sequence(packed_sequences: PackedSequence) -> list[Tensor]:
    """The inverse of pack_sequence: the list of sequences, in the batch's own order."""
    padded, lengths = pad_packed_sequence(packed_sequences, batch_first=True)
    return unpad_sequence(padded, lengths, batch_first=True)
