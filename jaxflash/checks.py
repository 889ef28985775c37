"""Run-time checks of values (not shapes): off unless asked for.

Shapes, dtypes and static arguments are checked at trace time and raise
right away (attention._validate). Sequence lengths are values, known only on
the device: a length outside [0, sequence length] is clamped, as jax.nn's
masks treat it (past the end means the whole sequence, below 0 none). Code
that wants an error instead runs under `checked`, which turns the checks
planted here (`checkify.debug_check`, a no-op otherwise) into a ValueError.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import checkify


def lengths_in_range(lengths, name: str, limit: int) -> None:
  """Plants the check `0 <= lengths <= limit` for `checked`; costs nothing otherwise."""
  if lengths is None:
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
    error, out = checkified(*args, **kwargs)
    error.throw()
    return out
  return run
