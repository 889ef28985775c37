"""A small sweep of every CUDA kernel family, forward and backward, for
compute-sanitizer. Run as

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
        --kernel-name kns=jaxflash python tools/sanitizer_sweep.py

(the platform allocator gives each buffer its own allocation, so an
out-of-bounds access is not hidden inside XLA's pool).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

SHAPES = [(1, 1, 17, 2, 1, 64), (2, 37, 45, 4, 2, 128), (1, 70, 70, 2, 2, 40), (1, 33, 65, 2, 1, 256),
          (1, 150, 333, 2, 1, 128),  # walks several K/V tiles through both pipeline stages
          (3, 300, 260, 16, 4, 64)]  # more work tiles than SMs: persistent CTAs take several
MASKS = [dict(), dict(is_causal=True, causal_alignment="bottom_right"),
         dict(local_window_size=(5, 3), query_seq_lengths=np.array([0], np.int32)[:1]),
         dict(key_value_seq_lengths=None)]  # ragged keys: padding inside the tensor
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def main():
  rng = np.random.default_rng(0)
  n = 0
  for (B, T, S, N, K, D), mask, dtype in itertools.product(SHAPES, MASKS, DTYPES):
    if "query_seq_lengths" in mask:
      mask = dict(mask, query_seq_lengths=rng.integers(0, T + 1, B).astype(np.int32))
    if "key_value_seq_lengths" in mask:
      mask = dict(mask, key_value_seq_lengths=rng.integers(1, S + 1, B).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, D)), dtype)
    loss = lambda q, k, v: jnp.sum(jaxflash.dot_product_attention(
        q, k, v, implementation="native", **mask).astype(jnp.float32))
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    for det in (True,):
      f = lambda q: jnp.sum(jaxflash.dot_product_attention(
          q, k, v, implementation="native", deterministic=det, **mask).astype(jnp.float32))
      jax.block_until_ready(jax.grad(f)(q))
    n += 1
  print(f"sanitizer sweep: {n} configurations, forward and backward")


if __name__ == "__main__":
  main()
