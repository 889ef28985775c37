"""What the Pallas attention kernels share inside a program.

The mask rule of one batch element (`Mask`), the ranges of blocks a program
walks, the scores (`Scores`: scale and optional soft-cap; `Alibi`: ALiBi's
bias) and the tile helpers
every kernel uses: the float32 tile product, the zeroing of padding rows and
keys, the pair-by-pair recomputation of a block that shows a NaN, and the
base-2 LSE.

Every kernel splits its walk into three ranges of blocks: a masked range at
each end and an unmasked interior of tiles that are entirely visible, so the
per-element mask is evaluated only on boundary tiles. Blocks the mask
excludes entirely are never visited.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxflash import segments as _segments
from jaxflash.pallas.config import EMPTY_LSE, LOG2E


# ---------------------------------------------------------------------------
# Mask arithmetic (scalars and vectors of int32; left/right are static ints)
# ---------------------------------------------------------------------------


_MAX_OFFSET = 1 << 30  # bound of the diagonal offsets (sequences are shorter)


@dataclasses.dataclass(frozen=True)
class Mask:
  """The mask rule for one batch element, evaluated inside a kernel.

  With segment ids, `q_tab` / `kv_tab` are this batch element's segment tables
  (segments.py: [positions, FIELDS] int32 refs): the block ranges come from their
  envelopes and runs, as the native kernels' MaskPolicy takes them, and the element
  mask adds the id comparison (`visible`'s `ids`)."""

  q_valid: jax.Array    # rows [0, q_valid) are real queries
  kv_valid: jax.Array   # keys [0, kv_valid) exist
  offset: jax.Array     # diagonal position of row 0
  left: int             # static; < 0 unbounded
  right: int            # static; < 0 unbounded
  q_tab: object = None  # segment tables (refs), or None without ids
  kv_tab: object = None

  @classmethod
  def make(cls, q_valid, kv_valid, extra, left, right, bottom_right, tables=(None, None)):
    # Saturated at +-2^30 like the native kernels' MaskPolicy.
    extra = jnp.clip(extra, -_MAX_OFFSET, _MAX_OFFSET)
    offset = (kv_valid - q_valid if bottom_right else jnp.int32(0)) + extra
    return cls(q_valid, kv_valid, jnp.clip(offset, -_MAX_OFFSET, _MAX_OFFSET), left, right,
               *tables)

  @property
  def segmented(self) -> bool:
    return self.q_tab is not None

  def row_ids(self, r0, n: int):
    """The segment ids of rows [r0, r0 + n) ([n] int32), None without ids."""
    return None if self.q_tab is None else self.q_tab[pl.ds(r0, n), _segments.ID]

  def key_ids(self, c0, n: int):
    """The segment ids of keys [c0, c0 + n), None without ids."""
    return None if self.kv_tab is None else self.kv_tab[pl.ds(c0, n), _segments.ID]

  def with_keys(self, q_ids, c0, n: int):
    """`visible`'s ids for a query-major tile: rows with ids `q_ids` ([bq], `row_ids`)
    against keys [c0, c0 + n); None without ids."""
    return None if q_ids is None else (q_ids[:, None], self.key_ids(c0, n)[None, :])

  def with_rows(self, k_ids, r0, n: int):
    """The same for a key-major tile: keys with ids `k_ids` against rows [r0, r0 + n)."""
    return None if k_ids is None else (self.row_ids(r0, n)[None, :], k_ids[:, None])

  # Keys visible to row r: [key_begin(r), key_end(r)); both non-decreasing.
  def key_begin(self, row):
    if self.left < 0:
      return jnp.zeros_like(row)
    return jnp.maximum(row + self.offset - self.left, 0)

  def key_end(self, row):
    if self.right < 0:
      return jnp.broadcast_to(self.kv_valid, jnp.shape(row))
    return jnp.clip(row + self.offset + (self.right + 1), 0, self.kv_valid)

  # Rows that see key c: [row_begin(c), row_end(c)) for c < kv_valid.
  def row_begin(self, col):
    if self.right < 0:
      return jnp.zeros_like(col)
    return jnp.clip(col - self.offset - self.right, 0, self.q_valid)

  def row_end(self, col):
    if self.left < 0:
      return jnp.broadcast_to(self.q_valid, jnp.shape(col))
    return jnp.clip(col - self.offset + (self.left + 1), 0, self.q_valid)

  def visible(self, rows, cols, ids=None):
    """Element mask for rows [bq, 1] x cols [1, bk]; `ids` = (row ids, key ids)
    shaped like them (`row_ids`, `key_ids`) where the call has segment ids."""
    vis = (rows < self.q_valid) & (cols < self.kv_valid)
    if self.left >= 0:
      vis &= cols >= rows + self.offset - self.left
    if self.right >= 0:
      vis &= cols <= rows + self.offset + self.right
    if ids is not None:
      vis &= ids[0] == ids[1]
    return vis

  def has_keys(self, rows, r0=None):
    """Rows that see at least one key (the others output zeros); with segment ids
    `rows` must be the block [r0, r0 + len(rows))."""
    if self.q_tab is not None:
      n = rows.shape[0]
      begin = self.q_tab[pl.ds(r0, n), _segments.BEGIN]
      end = self.q_tab[pl.ds(r0, n), _segments.END]
      return (rows < self.q_valid) & (begin < end)
    return (rows < self.q_valid) & (self.key_begin(rows) < self.key_end(rows))


# ---------------------------------------------------------------------------
# Block ranges
# ---------------------------------------------------------------------------


def _cdiv(a, b: int):
  return lax.div(a + (b - 1), jnp.int32(b))


def three_ranges(lo_elem, hi_elem, full_lo_elem, full_hi_elem, all_full,
                 block: int):
  """Splits the element range [lo_elem, hi_elem) into block ranges.

  Returns (lo, a, b, hi): blocks [lo, a) and [b, hi) need the element mask,
  blocks [a, b) are entirely visible. ``full_lo_elem``/``full_hi_elem`` bound
  the elements that every row/column of the tile sees; ``all_full`` is a
  scalar bool saying whether full tiles can exist at all.
  """
  nonempty = hi_elem > lo_elem
  lo = lax.div(lo_elem, jnp.int32(block))
  hi = jnp.where(nonempty, _cdiv(hi_elem, block), lo)
  a = jnp.clip(_cdiv(full_lo_elem, block), lo, hi)
  b = jnp.clip(lax.div(full_hi_elem, jnp.int32(block)), a, hi)
  b = jnp.where(all_full, b, a)
  return lo, a, b, hi


def _table_ranges(tab, first, n: int, valid, block: int):
  """three_ranges of the other side's positions that positions [first, first + n)
  of one side see, from that side's segment table: the envelopes bound them, and
  the positions see an interval whole when they are one run of one id whose first
  and last see theirs without gaps (mask.h's FullKeys, either side)."""
  S = _segments
  last = jnp.minimum(first + n, valid) - 1
  exist = last >= first
  last = jnp.maximum(last, 0)
  lo_elem = jnp.where(exist, tab[first, S.ENV_BEGIN], 0)
  hi_elem = jnp.where(exist, tab[last, S.ENV_END], 0)
  whole = ((first + n <= valid) & (tab[first, S.RUN_END] >= first + n) &
           (tab[first, S.GAP_FREE] != 0) & (tab[last, S.GAP_FREE] != 0))
  return three_ranges(lo_elem, hi_elem, tab[last, S.BEGIN], tab[first, S.END], whole, block)


def query_blocks(mask, c0, block_k: int, block_q: int):
  """Query blocks that see keys [c0, c0 + block_k), as three_ranges splits them:
  the dK/dV kernel's walk."""
  if mask.segmented:
    return _table_ranges(mask.kv_tab, c0, block_k, mask.kv_valid, block_q)
  last_col = jnp.minimum(c0 + block_k, mask.kv_valid) - 1
  cols_exist = last_col >= c0
  lo_elem = jnp.where(cols_exist, mask.row_begin(c0), 0)
  hi_elem = jnp.where(cols_exist, mask.row_end(jnp.maximum(last_col, 0)), 0)
  all_cols = c0 + block_k <= mask.kv_valid
  return three_ranges(lo_elem, hi_elem, mask.row_begin(c0 + block_k - 1), mask.row_end(c0),
                      all_cols, block_q)


def key_blocks(mask, r0, block_q: int, block_k: int):
  """Key blocks the query rows [r0, r0 + block_q) visit, as three_ranges
  splits them (masked head, unmasked interior, masked tail). Shared by the
  forward and dQ kernels, which walk keys for a fixed block of rows."""
  if mask.segmented:
    return _table_ranges(mask.q_tab, r0, block_q, mask.q_valid, block_k)
  last_row = jnp.minimum(r0 + block_q, mask.q_valid) - 1
  rows_exist = last_row >= r0
  lo_elem = mask.key_begin(r0)
  hi_elem = jnp.where(rows_exist, mask.key_end(jnp.maximum(last_row, 0)), 0)
  all_rows = r0 + block_q <= mask.q_valid
  return three_ranges(lo_elem, hi_elem, mask.key_begin(r0 + block_q - 1), mask.key_end(r0),
                      all_rows, block_k)


def query_block(q_len_ref, kv_len_ref, off_ref, *, left: int, right: int, bottom_right: bool,
                block_q: int, block_k: int, num_q_blocks: int, tables=(None, None)):
  """The query block of this program (grid axis 0, heaviest causal blocks
  first; axis 1 the batch element): its mask, first row, rows [bq, 1] and the
  key-block ranges (lo, a, b, hi) of `key_blocks`. `tables`: the batch element's
  segment table refs (`take_extras`), or None."""
  qi = num_q_blocks - 1 - pl.program_id(0)
  b = pl.program_id(1)
  mask = Mask.make(q_len_ref[b], kv_len_ref[b], off_ref[b], left, right, bottom_right, tables)
  r0 = qi * block_q
  rows = r0 + jnp.arange(block_q, dtype=jnp.int32)[:, None]
  return mask, r0, rows, key_blocks(mask, r0, block_q, block_k)


# ---------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Scores:
  """How a product q . k becomes a score s, in float32 and before the mask.

  With u = scale * q . k, s = u, or with a soft-cap c > 0, s = c tanh(u / c)
  (tanh takes +-inf to +-1 and keeps NaN). Both fields are static: with c = 0
  the kernels trace exactly the uncapped arithmetic, one multiplier folding
  scale and log2(e).
  """

  scale: float
  softcap: float = 0.0

  def log2(self, qk):
    """s * log2(e) of the raw products `qk` (the kernels' exp2 domain)."""
    if not self.softcap:
      return qk * (self.scale * LOG2E)
    return jnp.tanh(qk * (self.scale / self.softcap)) * (self.softcap * LOG2E)

  def chain(self, ds, s2, visible=None):
    """A derivative w.r.t. s times ds/du = 1 - (s / c)^2, from `s2` = `log2`'s
    result: dS to dS_u in the backward, tS_u to tS in the tangent.

    `visible` (a masked tile's pairs) zeroes the factor of masked pairs, whose
    score may be NaN (padding): their zero weight must stay an exact zero.
    Without a cap the factor is 1 and `ds` is returned as is.
    """
    if not self.softcap:
      return ds
    t = s2 * (1.0 / (self.softcap * LOG2E))
    slope = 1.0 - t * t
    if visible is not None:
      slope = jnp.where(visible, slope, 0.0)
    return ds * slope


@dataclasses.dataclass(frozen=True)
class Alibi:
  """ALiBi's bias inside a program: -slope * |q + offset - k| (reference.alibi_bias)
  in the kernels' log2 units, added to a score after `Scores.log2` (so a soft-cap's
  `chain` still reads the capped score). `neg_slope2` is None without slopes: `add`
  then returns the scores untouched and nothing is traced."""

  neg_slope2: jax.Array | None = None
  offset: jax.Array | int = 0

  @classmethod
  def of(cls, slope_ref, index, mask: Mask):
    """The bias of slope `slope_ref[index]` (None: no slopes) under `mask`'s diagonal."""
    if slope_ref is None:
      return cls()
    return cls(slope_ref[index] * -LOG2E, mask.offset)

  def add(self, s, q, k):
    """s plus the bias of query rows `q` and keys `k` (int32, broadcastable to s)."""
    if self.neg_slope2 is None:
      return s
    return s + self.neg_slope2 * jnp.abs(q + self.offset - k).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class DenseTile:
  """A program's dense bias and mask (jaxflash/dense.py; host.dense_operands lays them
  out): refs over the program's rows and keys, a broadcast axis of size 1. Query-major
  programs (forward, dQ) hold [rows, keys] refs and read a block of keys; key-major
  ones (dK/dV) hold [heads, rows, keys] refs and read a block of rows of head g,
  returned transposed ([keys, rows], like their tiles). The mask is int8 with a
  summary per tile (0: all hidden; `walk` skips those). Without them every method is a
  no-op."""

  bias: object = None
  mask: object = None
  summary: object = None
  key_major: bool = False

  @classmethod
  def take(cls, refs, bias: bool, mask: bool, key_major: bool):
    """(DenseTile, the other refs): the dense refs come first when the call has them."""
    n = int(bias) + 2 * int(mask)
    got = list(refs[:n])
    tile = cls(got.pop(0) if bias else None, *(got if mask else (None, None)),
               key_major=key_major)
    return tile, refs[n:]

  def _read(self, ref, at, n: int, g=0):
    """A block of `n` keys from `at` (query-major) or of `n` rows of head g (key-major)."""
    if not self.key_major:
      return ref[:, pl.ds(at, n)] if ref.shape[-1] > 1 else ref[...]
    head = g if ref.shape[0] > 1 else 0
    rows = pl.ds(at, n) if ref.shape[1] > 1 else pl.ds(0, 1)
    return ref[head, rows, :].T

  def add(self, s, at, n: int, g=0):
    """s (log2 units) plus the bias of the block at `at` (see `_read`)."""
    if self.bias is None:
      return s
    return s + self._read(self.bias, at, n, g).astype(jnp.float32) * LOG2E

  def shows(self, at, n: int, g=0):
    """Boolean: the pairs of the block the mask shows, broadcastable to the tile; None
    without a mask."""
    return None if self.mask is None else self._read(self.mask, at, n, g) != 0

  def hidden(self, index, g=0):
    """Whether the mask hides the whole tile `index` (a key block of a query-major
    program, a query block of a key-major one): such tiles are skipped."""
    ref = self.summary
    if self.key_major:
      return ref[g if ref.shape[0] > 1 else 0, index if ref.shape[1] > 1 else 0, 0] == 0
    return ref[0, index if ref.shape[-1] > 1 else 0] == 0

  def walk(self, body, g=0):
    """`body(index, carry)` of a block loop, skipping the tiles the mask hides."""
    if self.summary is None:
      return body
    return lambda index, carry: lax.cond(self.hidden(index, g), lambda c: c,
                                         functools.partial(body, index), carry)


def both(a, b):
  """a & b where either may be None (no condition)."""
  return b if a is None else a if b is None else a & b


def take_extras(refs, alibi: bool, segments: bool):
  """(slope_ref or None, (q table ref, kv table ref) or (None, None), the other refs):
  a kernel's refs after its lengths and offsets begin with the slopes when the call
  has ALiBi, then its segment tables when it has segment ids."""
  slope_ref, refs = (refs[0], refs[1:]) if alibi else (None, refs)
  tables, refs = (tuple(refs[:2]), refs[2:]) if segments else ((None, None), refs)
  return slope_ref, tables, refs


# ---------------------------------------------------------------------------
# Tile helpers
# ---------------------------------------------------------------------------


def dot(a, b, contract_a: int, contract_b: int):
  # HIGHEST: float32 operands get IEEE products on GPU (Triton's default for
  # them is TF32, whose 1e-3 error is amplified in dS = P * (dP - delta)).
  # Half-precision operands are unaffected.
  return lax.dot_general(
      a, b, (((contract_a,), (contract_b,)), ((), ())),
      precision=(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
      preferred_element_type=jnp.float32)


def zero_padding(x, index, valid):
  """Rows of a loaded tile at or past `valid` (padding) set to 0, so that a
  masked pair's zero weight never meets a NaN there."""
  return jnp.where(index < valid, x, jnp.zeros_like(x))


def exact_where_nan(xs, rows_ok, exact):
  """`xs` (a tuple of [rows, cols] or [rows] results), or `exact(xs)` when a
  NaN shows in a row that `rows_ok` flags.

  A product over a partly masked tile multiplies masked pairs by an exact
  zero weight, and 0 * NaN (or Inf) of a key the row cannot see would be NaN.
  Any such leak leaves a NaN in the result, so a block that has one is
  recomputed pair by pair over the visible pairs only: exact, and slow, but
  run only when an input is not finite.
  """
  # A max over int32 flags: Triton has no lowering for jnp.any.
  bad = functools.reduce(jnp.maximum, [
      jnp.max((jnp.isnan(x) & (rows_ok if x.ndim == 1 else rows_ok[:, None])).astype(jnp.int32))
      for x in xs]) > 0
  return lax.cond(bad, exact, lambda xs: xs, xs)


def lse_log2(lse):
  """Base-2 LSE; rows that saw nothing get +inf, so that P underflows to 0."""
  return jnp.where(lse == EMPTY_LSE, jnp.inf, lse * LOG2E)
