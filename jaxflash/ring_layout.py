"""The sequence layouts of ring attention (ring.py) and of the partition rule's ring.

What each shard of the sequence axis holds (the sequence cut into equal chunks):

* ``"contiguous"``: shard i holds chunk i of n (what sharding an array gives).
* ``"zigzag"``: the sequence cut into 2n chunks; shard i holds chunks i and
  2n - 1 - i, in that order. Under a causal mask every shard then does the
  same work at every step; `zigzag_order` / `zigzag_restore` permute a global
  sequence into and out of this order.
* ``"mirror"``: the partition rule's causal ring (`to_mirror`): shard p holds
  chunks 2p and 2n - 1 - 2p, one collective permute of half a shard away from
  the contiguous layout.

`Sharded` says how one sequence axis is spread and moves pieces along the ring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _zigzag_chunks(num_shards: int) -> np.ndarray:
  """Chunk order of the zigzag layout: shard i holds chunks i and 2n-1-i."""
  n = num_shards
  return np.array([c for i in range(n) for c in (i, 2 * n - 1 - i)])


def _check_chunks(x, num_shards: int, axis: int) -> None:
  if not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
  if x.shape[axis] % (2 * num_shards):
    raise ValueError(f"the zigzag layout cuts the sequence into 2 * num_shards = {2 * num_shards} "
                     f"equal chunks; axis {axis} has length {x.shape[axis]}")


def zigzag_order(x, num_shards: int, axis: int = 1):
  """Permutes the sequence axis into the zigzag order.

  Sharding the result evenly over ``num_shards`` devices along ``axis`` gives
  shard i the chunks i and 2n-1-i of the original sequence (n = num_shards),
  the layout `ring_attention(..., layout="zigzag")` expects. Apply it to
  everything that is indexed by position (tokens, positions, labels);
  `zigzag_restore` undoes it.
  """
  x = jnp.asarray(x)
  _check_chunks(x, num_shards, axis)
  chunks = jnp.split(x, 2 * num_shards, axis=axis)
  return jnp.concatenate([chunks[c] for c in _zigzag_chunks(num_shards)], axis=axis)


def zigzag_restore(x, num_shards: int, axis: int = 1):
  """The inverse of `zigzag_order`: back to the natural sequence order."""
  x = jnp.asarray(x)
  _check_chunks(x, num_shards, axis)
  chunks = jnp.split(x, 2 * num_shards, axis=axis)
  inverse = np.argsort(_zigzag_chunks(num_shards))
  return jnp.concatenate([chunks[i] for i in inverse], axis=axis)


@dataclasses.dataclass(frozen=True)
class Sharded:
  """How one sequence axis is spread: the mesh axis (or axes), its size, the layout."""
  axis: Any = None          # mesh axis name, tuple of names, or None (not sharded)
  shards: int = 1
  layout: str = "contiguous"       # a Layout, or "mirror" (the partition rule's: to_mirror)

  @property
  def pieces(self) -> int:
    return 1 if self.layout == "contiguous" else 2

  def index(self):
    return lax.axis_index(self.axis) if self.axis is not None else jnp.int32(0)

  def starts(self, shard, local_len: int) -> list:
    """Global positions of the shard's pieces (traced; `shard` may be traced)."""
    piece = local_len // self.pieces
    if self.layout == "zigzag":
      return [shard * piece, (2 * self.shards - 1 - shard) * piece]
    if self.layout == "mirror":
      return [2 * shard * piece, (2 * self.shards - 1 - 2 * shard) * piece]
    return [shard * local_len]

  def send(self, tree):
    """Moves `tree` one hop along the ring: shard i receives shard i - 1's."""
    n = self.shards
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, self.axis, perm), tree)

  def home(self, pieces, axis: int):
    """The sums that travelled with the keys, at their owners, pieces joined on `axis`.

    After the last step shard i holds the pieces of shard i + 1's keys: one
    more hop. In the mirror layout each piece goes straight to the shard that
    holds it in the contiguous layout instead (piece 0, chunk 2(i+1), to shard
    i + 1; piece 1, chunk 2n - 3 - 2i, to shard n - 2 - i), so the result is
    already contiguous: no swap back (`from_mirror`), and at two shards piece
    1 stays where it is.
    """
    if self.shards > 1 and self.layout == "mirror":
      n = self.shards
      pieces = (self.send(pieces[0]),
                lax.ppermute(pieces[1], self.axis, [(i, (n - 2 - i) % n) for i in range(n)]))
    elif self.shards > 1:
      pieces = self.send(pieces)
    return jnp.concatenate(pieces, axis=axis)


class _FirstHalf:
  """The first half of `whole` along `axis`, sliced only inside the block that reads it.

  A piece of the mirror layout that never moved (`to_mirror`): slicing it up
  front would keep a copy alive through the whole ring (`_piece`).
  """

  def __init__(self, whole, axis: int):
    self.whole, self.axis = whole, axis

  @property
  def shape(self):
    return tuple(s // 2 if i == self.axis else s for i, s in enumerate(self.whole.shape))

  @property
  def dtype(self):
    return self.whole.dtype

  def value(self):
    half = self.whole.shape[self.axis] // 2
    return lax.slice_in_dim(self.whole, 0, half, axis=self.axis)


def _mirror_perm(n: int):
  return [(p, n - 1 - p) for p in range(n)]


def to_mirror(xs, seq: Sharded, axes, lazy):
  """The two pieces of the mirror layout of each local contiguous shard in `xs`.

  Mirror layout (the partition rule's causal ring): shard p holds chunks 2p
  and 2n-1-2p of 2n, the first half of its own contiguous shard and the
  second half of shard n-1-p's. Like zigzag's pairs (i, 2n-1-i), every such
  pair does the same causal work as any other at every ring step; unlike
  zigzag it is one collective permute of half a shard away (p <-> n-1-p), and
  the half that stays is not copied: where `lazy` says so it comes as a
  `_FirstHalf` (for operands that only blocks read, not for K/V, which
  travel). `axes` gives each operand's sequence axis.

  Every swap has arrived before a block reads any received piece (one
  optimization barrier over all of them): a swap left for the scheduler to
  place could land between blocks, where devices with different blocks wait
  (`_steps`). Only the first step's (first, first) block, the same diagonal
  block on every device, can run before them. (A barrier over the whole
  shards as well kept copies alive: 1.18x -> 1.25x of one device's memory,
  XLA CPU buffer assignment, bench_sharding --cpu-memory. K/V sliced lazily
  too: 1.15x there, but 0.84x -> 0.86x of one GPU's peak on two H200s.)
  """
  halves = [x.shape[a] // 2 for x, a in zip(xs, axes)]
  received = tuple(lax.ppermute(lax.slice_in_dim(x, h, 2 * h, axis=a), seq.axis,
                                _mirror_perm(seq.shards))
                   for x, a, h in zip(xs, axes, halves))
  received = lax.optimization_barrier(received)
  firsts = (_FirstHalf(x, a) if l else lax.slice_in_dim(x, 0, h, axis=a)
            for x, a, h, l in zip(xs, axes, halves, lazy))
  return tuple(zip(firsts, received))


def fold_output(o, do, dlse):
  """dLSE with the output's part of the backward's delta folded in: the backward
  then needs no O (`Ring.backward` with o None reads zeros in its place).

  The kernels' delta is rowsum(dO * O) - dLSE (params.h); with O zero and
  dLSE - rowsum(dO * O) it is the same number. The partition rule's causal
  ring folds before its re-layout, so O is not swapped and the caller's O can
  die before the ring runs.
  """
  prod = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)   # [B, T, N]
  return dlse.astype(jnp.float32) - jnp.transpose(prod, (0, 2, 1))


def from_mirror(x, seq: Sharded, seq_axis: int):
  """The local contiguous shard from `x` in the mirror layout (the same swap back)."""
  half = x.shape[seq_axis] // 2
  first, second = lax.slice_in_dim(x, 0, half, axis=seq_axis), lax.slice_in_dim(
      x, half, 2 * half, axis=seq_axis)
  return jnp.concatenate([first, lax.ppermute(second, seq.axis, _mirror_perm(seq.shards))],
                         axis=seq_axis)
