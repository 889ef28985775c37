"""Run-time checks of values (not shapes): off unless asked for.

Shapes, dtypes and static arguments are checked at trace time and raise
right away (`_core.validate`). Sequence lengths are values, known only on
the device: a length outside [0, sequence length] is clamped, as jax.nn's
masks treat it (past the end means the whole sequence, below 0 none). Code
that wants an error instead runs under `checked`, which plants the checks
here (`checkify.debug_check`) and turns a failed one into a ValueError.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

# Whether the checks are planted: only while `checked` runs. A planted
# `debug_check` computes nothing outside checkify, but its effect stays in the
# jaxpr and keeps every call of the jitted function off jax.jit's C++ fast
# path: ~50 us more host time per call on a CPU, 200 on an H100 (a decode step
# with lengths measured 300 us instead of 207; fifteenth session in
# docs/performance-log.md). A jit-cache context, so a function traced outside
# `checked` is traced again, with the checks, when called inside it and the
# other way round. (JAX without user contexts plants them always.)
_planting = jax.make_user_context(default_value=False) if hasattr(jax, "make_user_context") else None


def lengths_in_range(lengths, name: str, limit: int) -> None:
  """Plants the check `0 <= lengths <= limit` when `checked` runs."""
  if lengths is None or (_planting is not None and not _planting.value):
    return
  checkify.debug_check(jnp.all((lengths >= 0) & (lengths <= limit)),
                       f"{name} must lie in [0, {limit}] (the sequence length); got {{lengths}}",
                       lengths=lengths)


def checked(fn):
  """`fn`, raising where jaxflash would clamp: out-of-range sequence lengths.

  Wraps any function that calls `jaxflash.dot_product_attention`, jitted or
  not (`checked(jax.jit(loss))` works), and raises `ValueError`
  (`jax.experimental.checkify.JaxRuntimeError`) naming the argument and its
  range when a length lies outside [0, sequence length]. Without it such a
  length is clamped. Inside a `checkify.checkify` of your own, the checks are
  `checkify.user_checks`.
  """
  checkified = checkify.checkify(fn, errors=checkify.user_checks)

  @functools.wraps(fn)
  def run(*args, **kwargs):
    with _planting(True) if _planting is not None else contextlib.nullcontext():
      error, out = checkified(*args, **kwargs)
    error.throw()
    return out
  return run
