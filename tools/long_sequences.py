"""Long sequences on one GPU: S = 128k and 256k forward + backward, 1M forward.

Causal, bfloat16, B = 1, 8 heads, head dim 128, through the public API (the
automatic implementation choice). Every output and gradient must be finite;
sampled query rows (O, LSE, dQ) and sampled keys (dK, dV) are compared with a
float32 reference computed in chunks of keys (rows) so that no score matrix is
ever materialised. The key gradients' reference uses the kernels' LSE for the
rows it sums over (checked itself on the sampled rows). A size whose tensors
would not fit in the device memory is skipped with a note, so the script runs
as far as the GPU allows (S = 1M forward needs about 10 GB: an H200 or H100).

  python tools/long_sequences.py [--seq 131072 262144] [--forward-only 1048576]

Prints one line per size and exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxflash

H, D = 8, 128
ROWS = 12  # sampled query rows (first and last included)
HIGHEST = jax.lax.Precision.HIGHEST


def _bytes(S, backward):
  """Device bytes the call needs, roughly: q, k, v, o (+ do, dq, dk, dv and
  the backward's workspace) in bf16, LSE in float32."""
  tensors = 8 if backward else 4
  return tensors * S * H * D * 2 + 3 * S * H * 4


def _free_bytes():
  stats = jax.devices()[0].memory_stats()
  if not stats:  # the CPU reports none: its memory is the machine's
    return float("inf")
  return stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)


def _chunk(length):
  """Keys (or rows) per reference step: 32k, or the whole sequence when shorter."""
  return min(1 << 15, length)


def _slice(x, start, size):
  """x[start:start + size] along the sequence axis, in float32."""
  return jax.lax.dynamic_slice_in_dim(x, start, size).astype(jnp.float32)


def _probs(s, visible, lse):
  """exp(s - lse) on the visible pairs, exactly 0 on the others."""
  return jnp.where(visible, jnp.exp(jnp.where(visible, s - lse, 0)), 0)


@jax.jit
def _reference_rows(q_rows, rows, k, v, do_rows, scale):
  """O, LSE and dQ of the sampled causal rows in float32, keys in chunks."""
  S = k.shape[0]
  CHUNK = _chunk(S)
  q = q_rows.astype(jnp.float32) * scale                       # [R, H, D]

  def lse_step(carry, j0):
    m, l = carry
    s = jnp.einsum("rhd,shd->rhs", q, _slice(k, j0, CHUNK), precision=HIGHEST)
    s = jnp.where(j0 + jnp.arange(CHUNK)[None, None, :] <= rows[:, None, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    l = l * jnp.exp(m - m_new) + jnp.exp(s - m_new[..., None]).sum(-1)
    return (m_new, l), None

  starts = jnp.arange(S // CHUNK) * CHUNK
  R = q.shape[0]
  (m, l), _ = jax.lax.scan(lse_step, (jnp.full((R, H), -jnp.inf), jnp.zeros((R, H))), starts)
  lse = m + jnp.log(l)

  def probabilities(j0):  # P of the sampled rows and key chunk j0, and the chunk
    kc, vc = _slice(k, j0, CHUNK), _slice(v, j0, CHUNK)
    s = jnp.einsum("rhd,shd->rhs", q, kc, precision=HIGHEST)
    vis = j0 + jnp.arange(CHUNK)[None, None, :] <= rows[:, None, None]
    return _probs(s, vis, lse[..., None]), kc, vc

  def out_step(o, j0):
    p, _, vc = probabilities(j0)
    return o + jnp.einsum("rhs,shd->rhd", p, vc, precision=HIGHEST), None

  o, _ = jax.lax.scan(out_step, jnp.zeros_like(q), starts)
  delta = jnp.einsum("rhd,rhd->rh", do_rows.astype(jnp.float32), o, precision=HIGHEST)

  def dq_step(dq, j0):
    p, kc, vc = probabilities(j0)
    dp = jnp.einsum("rhd,shd->rhs", do_rows.astype(jnp.float32), vc, precision=HIGHEST)
    ds = p * (dp - delta[..., None])
    return dq + scale * jnp.einsum("rhs,shd->rhd", ds, kc, precision=HIGHEST), None

  dq, _ = jax.lax.scan(dq_step, jnp.zeros_like(q), starts)
  return o, lse, dq


@jax.jit
def _reference_keys(keys, q, k_keys, v_keys, do, lse, delta, scale):
  """dK and dV of the sampled keys in float32, query rows in chunks; LSE and
  delta of every row come from the kernels' outputs."""
  T = q.shape[0]
  CHUNK = _chunk(T)
  kk = k_keys.astype(jnp.float32) * scale                     # [C, H, D]

  def step(carry, i0):
    dk, dv = carry
    qc, doc = _slice(q, i0, CHUNK), _slice(do, i0, CHUNK)
    lc, dc = _slice(lse, i0, CHUNK), _slice(delta, i0, CHUNK)  # [chunk, H]
    s = jnp.einsum("chd,thd->cht", kk, qc, precision=HIGHEST)
    vis = i0 + jnp.arange(CHUNK)[None, None, :] >= keys[:, None, None]
    p = _probs(s, vis, lc.T[None])
    dp = jnp.einsum("chd,thd->cht", v_keys.astype(jnp.float32), doc, precision=HIGHEST)
    ds = p * (dp - dc.T[None])
    return (dk + scale * jnp.einsum("cht,thd->chd", ds, qc, precision=HIGHEST),
            dv + jnp.einsum("cht,thd->chd", p, doc, precision=HIGHEST)), None

  zeros = jnp.zeros(kk.shape, jnp.float32)
  (dk, dv), _ = jax.lax.scan(step, (zeros, zeros), jnp.arange(T // CHUNK) * CHUNK)
  return dk, dv


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def run(S: int, backward: bool, rng) -> bool:
  need = _bytes(S, backward)
  if need > 0.8 * _free_bytes():
    print(f"S={S:>8} {'fwd+bwd' if backward else 'fwd'}: skipped, needs ~{need / 2**30:.1f} GiB "
          f"of {_free_bytes() / 2**30:.1f} GiB free")
    return True
  key = jax.random.PRNGKey(S)
  kq, kk, kv, kd = jax.random.split(key, 4)
  shape = (1, S, H, D)
  q, k, v, do = (jax.random.normal(x, shape, jnp.bfloat16) for x in (kq, kk, kv, kd))
  scale = 1.0 / np.sqrt(D)

  def attention(q, k, v):
    return jaxflash.dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                          residual_dtype=jnp.float32)

  fwd = jax.jit(attention)
  out, lse = jax.block_until_ready(fwd(q, k, v))
  start = time.perf_counter()
  out, lse = jax.block_until_ready(fwd(q, k, v))
  t_fwd = time.perf_counter() - start
  finite = bool(jnp.isfinite(out.astype(jnp.float32)).all() & jnp.isfinite(lse).all())
  grads, t_both = None, t_fwd
  if backward:  # forward and backward in one jitted step, as training runs them
    vjp = jax.jit(lambda q, k, v, do: jax.vjp(lambda *a: attention(*a)[0], q, k, v)[1](do))
    grads = jax.block_until_ready(vjp(q, k, v, do))
    start = time.perf_counter()
    grads = jax.block_until_ready(vjp(q, k, v, do))
    t_both = time.perf_counter() - start
    finite &= all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)

  rows = np.sort(np.concatenate([[0, S - 1], rng.choice(S, ROWS - 2, replace=False)]))
  rows_j = jnp.asarray(rows, jnp.int32)
  ref_o, ref_lse, ref_dq = _reference_rows(q[0, rows], rows_j, k[0], v[0], do[0, rows], scale)
  errs = {"o": _rel_err(out[0, rows], ref_o), "lse": _rel_err(lse[0, rows], ref_lse)}
  # bfloat16 outputs: a few ulps of rounding plus the sum's error; LSE in float32.
  limits = {"o": 2e-2, "lse": 1e-5, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}
  if backward:
    errs["dq"] = _rel_err(grads[0][0, rows], ref_dq)
    keys = np.sort(np.concatenate([[0, S - 1], rng.choice(S, ROWS - 2, replace=False)]))
    delta = jnp.einsum("thd,thd->th", do[0].astype(jnp.float32), out[0].astype(jnp.float32))
    ref_dk, ref_dv = _reference_keys(jnp.asarray(keys, jnp.int32), q[0], k[0, keys], v[0, keys],
                                     do[0], lse[0], delta, scale)
    errs["dk"] = _rel_err(grads[1][0, keys], ref_dk)
    errs["dv"] = _rel_err(grads[2][0, keys], ref_dv)
  ok = finite and all(errs[name] <= limits[name] for name in errs)
  flops = 4 * H * S * S * D / 2 * (3.5 if backward else 1)  # causal; backward 2.5x forward
  timing = f"fwd {t_fwd * 1e3:.0f} ms" + (f", fwd+bwd {t_both * 1e3:.0f} ms" if backward else "")
  print(f"S={S:>8} {'fwd+bwd' if backward else 'fwd'}: {'ok' if ok else 'FAILED'}, finite={finite}, "
        + ", ".join(f"{n} rel err {e:.1e}" for n, e in errs.items())
        + f"; {timing} ({flops / t_both / 1e12:.0f} TFLOP/s)")
  return ok


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, nargs="*", default=[131072, 262144])
  parser.add_argument("--forward-only", type=int, nargs="*", default=[1 << 20])
  args = parser.parse_args(argv)
  print(f"device: {jax.devices()[0].device_kind}; causal bf16, B=1, H={H}, D={D}")
  rng = np.random.default_rng(0)
  ok = all([run(S, True, rng) for S in args.seq] + [run(S, False, rng) for S in args.forward_only])
  print("long sequences: all checks passed" if ok else "long sequences: SOME CHECKS FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
