// GQA packing and split-KV bookkeeping, shared by the CPU and CUDA forwards.
//
// Packing: the query heads that share a K/V head are stacked into the rows of
// one tile, so every K/V tile is read once per K/V head instead of once per
// query head. Packed row r of (batch b, K/V head kv) is query row r / group of
// query head kv * group + r % group; since the heads of a group are adjacent
// in [.., q_heads, head_dim], a query row's group is one contiguous run.
//
// Split-KV: the key tiles a query tile visits are cut into num_splits
// contiguous spans, computed independently (more CTAs or work items when
// batch x K/V heads x query tiles is too small to fill the machine), then
// merged by the online-softmax rule:
//   lse = log2(sum_s 2^lse_s),  o = sum_s 2^(lse_s - lse) o_s
// where o_s is the normalised output and lse_s the base-2 log-sum-exp of
// split s. The row rules of params.h hold through the merge (SplitMerge): a
// split that sees no key of a row writes o_s = 0 and lse_s = kEmptyRowLse (a
// workspace value, finite so that jax.debug_infs stays quiet) and adds
// nothing; a row no split sees gets O = 0 and kEmptyRowLse. A split whose
// visible scores are all -inf writes its unnormalised o_s (0, or NaN from a
// non-finite value) and lse_s = -inf: it weighs 0, and a row made only of
// such splits gets 0 / 0 = NaN with LSE -inf, as a dense softmax gives it. A
// NaN lse_s makes the row NaN.
#pragma once

#include "jaxflash/params.h"

namespace jaxflash {

struct PackedRows {
  int group;  // query heads per K/V head
  int total;  // q_len * group packed rows per (batch, K/V head)

  JAXFLASH_HD static PackedRows For(const AttentionShape& sh) {
    const int group = static_cast<int>(sh.group_size());
    return {group, static_cast<int>(sh.q_len) * group};
  }
  JAXFLASH_HD int QueryRow(int r) const { return r / group; }
  JAXFLASH_HD int Head(int kv_head, int r) const { return kv_head * group + r % group; }
  // Element offset of packed row r of (batch, kv_head) in q, and in o (which
  // takes the value's head dim).
  JAXFLASH_HD int64_t Offset(const AttentionShape& sh, int batch, int kv_head, int r) const {
    return batch * sh.q_batch_stride() + QueryRow(r) * sh.q_row_stride() + Head(kv_head, r) * sh.head_dim;
  }
  JAXFLASH_HD int64_t OutOffset(const AttentionShape& sh, int batch, int kv_head, int r) const {
    return batch * sh.o_batch_stride() + QueryRow(r) * sh.o_row_stride() + Head(kv_head, r) * sh.v_dim();
  }
  // Index of packed row r in lse ([batch, q_heads, q_len]).
  JAXFLASH_HD int64_t LseIndex(const AttentionShape& sh, int batch, int kv_head, int r) const {
    return (batch * sh.q_heads + Head(kv_head, r)) * sh.q_len + QueryRow(r);
  }
  // Row of packed row r of split s in o_partial / lse_partial (params.h):
  // [batch, num_splits, q_len, q_heads].
  JAXFLASH_HD int64_t PartialRow(const AttentionShape& sh, int num_splits, int batch, int split, int kv_head,
                                 int r) const {
    return ((int64_t(batch) * num_splits + split) * sh.q_len + QueryRow(r)) * sh.q_heads + Head(kv_head, r);
  }
};

// Span [begin, end) of units (key tiles) that split `split` of `num_splits`
// takes out of [first, last): spans differ in length by at most one, and some
// are empty when there are more splits than units.
struct Span {
  int begin;
  int end;
};
JAXFLASH_HD Span SplitSpan(int first, int last, int split, int num_splits) {
  const int64_t n = last > first ? last - first : 0;
  return {first + static_cast<int>(n * split / num_splits), first + static_cast<int>(n * (split + 1) / num_splits)};
}

// One output row's merge (the rule above), given lse(s), the base-2 LSE of
// split s: whether any split saw a key of the row, and the shift of the
// weights 2^(lse_s - shift) (the largest lse_s, NaN-propagating; 0 when that
// is -inf, so no inf - inf appears). The caller sums the weights (Weight) and
// finishes with o = sum_s w_s o_s / sum and lse = log2(sum) + shift.
// Of folds the splits in order; a parallel merge folds subsets with Add,
// combines them with Join (the same max and or, so the result is the same) and
// ends with Finish.
struct SplitMerge {
  bool seen;
  float shift;

  JAXFLASH_HD static SplitMerge None() { return {false, -__builtin_huge_valf()}; }
  JAXFLASH_HD void Add(float lse_s) { Join({lse_s != kEmptyRowLse, lse_s}); }
  JAXFLASH_HD void Join(const SplitMerge& other) {
    seen |= other.seen;
    shift = (other.shift != other.shift || other.shift > shift) ? other.shift : shift;
  }
  JAXFLASH_HD void Finish() {
    if (shift == -__builtin_huge_valf()) shift = 0.f;
  }
  template <typename Lse>
  JAXFLASH_HD static SplitMerge Of(int num_splits, Lse&& lse) {
    SplitMerge m = None();
    for (int s = 0; s < num_splits; ++s) m.Add(lse(s));
    m.Finish();
    return m;
  }
  // Split s's weight, exactly 0 for a split that saw no key of the row (its
  // o_s is skipped, not multiplied).
  template <typename Exp2>
  JAXFLASH_HD float Weight(float lse_s, Exp2&& exp2) const {
    return lse_s == kEmptyRowLse ? 0.f : exp2(lse_s - shift);
  }
};

}  // namespace jaxflash
