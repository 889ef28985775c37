"""The automatic choice: the fused implementations `implementation=None` tries, fastest first.

Nothing here names a device or a head dim. The order for a call comes from a
measurement of its class, looked up in turn in

1. the per-device cache that `python -m jaxflash.tune --orders` writes on the
   user's own machine (tile_cache.py; orders of another build are stale);
2. the orders shipped with the package (orders.json: measured on the devices
   it names, with the command that wrote it in docs/performance.md);
3. the rule for a class no one measured: `FALLBACK`, the native kernels first
   (they are the ones compiled and tuned for every head-dim bucket).

A call's class is (device kind, dtype width, head-dim bucket, causal or not,
queries): "decode" for at most `DECODE_QUERIES` query rows, ordered by the
forward's time (a decode step is not differentiated), "small" for a CPU call of
at most `SMALL_SCORES` scores that hides no pair (`_core.automatic_order`), else
"train"; both ordered by forward+backward's time (nearly every training-length
call is differentiated).
The first implementation of the order that can serve the call runs
(`_core.choose`); whichever runs, the semantics are the same (README).
"""

from __future__ import annotations

import functools
import pathlib

import numpy as np

from jaxflash import tile_cache

SHIPPED = pathlib.Path(__file__).with_name("orders.json")
FALLBACK = ("native", "pallas")
# Query rows up to which a call is a decode step (measured at one row, tune
# --orders): where the Pallas decode kernel's lead ends. bench_decode.py on an
# H200 (2026-11-27): Pallas 0.95-1.07x native's speed at q_len 4, 0.78-0.83x at
# q_len 16, where the native kernels win.
DECODE_QUERIES = 4


# Scores (B·N·T·S) up to which a CPU call that hides no pair is "small": there the
# `xla` implementation, which materialises them (at the bound 64 KiB of float32),
# competes with the native kernels, whose fixed costs a call it undercuts (tune.py
# --orders --queries small measures the order; docs/performance.md, CPU). Measured on
# 2 cores (2026-12-02): xla 1.13-1.89x native's speed forward+backward at 2^12-2^14
# scores, even at 2^15, 0.68-0.92x at 2^16 (but for one head of 256 keys). Only where
# nothing is hidden does its dense softmax keep the kernels' NaN rules.
SMALL_SCORES = 1 << 14
SMALL_CANDIDATES = ("native", "xla")


def candidates(queries: str) -> tuple[str, ...]:
  """The implementations a class of these queries orders (xla in the small class only)."""
  return SMALL_CANDIDATES if queries == "small" else FALLBACK


def is_decode(q_len: int) -> bool:
  return q_len <= DECODE_QUERIES


def call_class(dtype, head_dim: int, causal: bool, q_len: int,
               small: bool = False) -> tuple[int, int | None, bool, str]:
  """(dtype width in bits, head-dim bucket, causal, queries) of a call; `small`: a CPU
  call of at most SMALL_SCORES scores that hides no pair."""
  queries = "decode" if is_decode(q_len) else "small" if small else "train"
  return (np.dtype(dtype).itemsize * 8, tile_cache.bucket(head_dim), bool(causal), queries)


@functools.lru_cache(maxsize=4)
def _shipped(file: str) -> tuple[tile_cache.Order, ...]:
  return tuple(tile_cache.read(pathlib.Path(file), "orders"))


def measured(device_kind: str, build) -> list[tile_cache.Order]:
  """The orders that speak for this device: the cache's of this build (`build()`, called
  only when the cache holds orders of the device), then the shipped ones."""
  cached = [o for o in tile_cache.read(kind="orders") if o.device == device_kind]
  if cached:
    current = build()
    cached = [o for o in cached if o.build == current]
  return cached + [o for o in _shipped(str(SHIPPED)) if o.device == device_kind]


def order(device_kind: str, build, dtype, head_dim: int, causal: bool,
          q_len: int, small: bool = False) -> tuple[str, ...]:
  """The implementations to try for a call of this class on this device, fastest first
  (`build`: as for `measured`)."""
  cell = (device_kind, *call_class(dtype, head_dim, causal, q_len, small))
  return next((o.order for o in measured(device_kind, build) if o.cell() == cell), FALLBACK)
