"""Shapes and masks the native, pallas and GPU tests share."""

from __future__ import annotations

import numpy as np

# (B, T, S, N, K, D): ragged T/S in {1, 17, 127, 1000}, q_len != kv_len, head
# dims that are not powers of two, GQA ratios 1, 2 and 8.
SHAPES = [
    (2, 1, 17, 4, 2, 40),
    (1, 17, 1, 2, 2, 64),
    (2, 127, 127, 8, 1, 72),
    (1, 1000, 127, 2, 2, 32),
    (1, 127, 1000, 4, 4, 128),
    (2, 17, 127, 8, 8, 256),
    (1, 64, 64, 16, 2, 8),
]

# Masks as keyword arguments of dot_product_attention; lengths are filled in
# per batch by `mask_kwargs`.
MASKS = {
    "none": {},
    "causal": dict(is_causal=True),
    "causal_bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "window": dict(local_window_size=(7, 3)),
    "window_causal_bottom_right": dict(local_window_size=(5, 2), is_causal=True,
                                       causal_alignment="bottom_right"),
    "lengths": dict(lengths=True),
    "lengths_causal_bottom_right": dict(lengths=True, is_causal=True,
                                        causal_alignment="bottom_right"),
}


def mask_kwargs(name: str, rng, B: int, T: int, S: int) -> dict:
  """API keyword arguments for mask `name`; lengths include 0 (fully masked)."""
  kw = dict(MASKS[name])
  if kw.pop("lengths", False):
    q_lengths = rng.integers(0, T + 1, size=B).astype(np.int32)
    kv_lengths = rng.integers(0, S + 1, size=B).astype(np.int32)
    kv_lengths[0] = 0 if B > 1 else kv_lengths[0]  # a batch element with no keys at all
    kw.update(query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths)
  return kw


def numpy_mask(kw: dict) -> dict:
  """The same mask in numpy_reference's terms."""
  left = right = -1
  if kw.get("local_window_size") is not None:
    left, right = kw["local_window_size"]
  if kw.get("is_causal"):
    right = 0 if right < 0 else min(right, 0)
  return dict(left=left, right=right, bottom_right=kw.get("causal_alignment") == "bottom_right",
              q_lengths=kw.get("query_seq_lengths"), kv_lengths=kw.get("key_value_seq_lengths"),
              segments=segment_ids(kw))


def segment_ids(kw: dict):
  """(q_ids, kv_ids) of a call's keywords (the key ids default to the query ids), or None."""
  if kw.get("query_segment_ids") is None:
    return None
  q_ids = np.asarray(kw["query_segment_ids"], np.int32)
  kv_ids = kw.get("key_value_segment_ids")
  return q_ids, q_ids if kv_ids is None else np.asarray(kv_ids, np.int32)
