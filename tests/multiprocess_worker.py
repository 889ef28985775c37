"""One process of test_multiprocess.py: `python multiprocess_worker.py PROCESS_ID PORT`.

Two of these form one JAX program over 2 processes × 4 host devices (gloo
collectives on the CPU). Each builds the same inputs, runs a jitted loss and its
gradients with q, k, v sharded over all 8 devices along the batch, the heads or
the sequence (ring attention), gathers the results and checks them against a
one-device run of the same step; it prints one line per layout that passed.
"""

import os
import sys

process_id, port = int(sys.argv[1]), int(sys.argv[2])
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after the flags above)

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import jaxflash  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8
mesh = jax.make_mesh((2, 4), ("hosts", "local"))
every_device = ("hosts", "local")
rng = np.random.default_rng(0)   # the same inputs in both processes
q, k, v = (rng.standard_normal((8, 128, 8, 32)).astype(np.float32) for _ in range(3))


def loss(q, k, v):
  return jnp.sum(jaxflash.dot_product_attention(q, k, v, is_causal=True) ** 2)


step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
with jax.default_device(jax.local_devices()[0]):
  want = jax.tree.leaves(step(q, k, v))

for name, spec in (("batch", P(every_device)), ("heads", P(None, None, every_device)),
                   ("sequence", P(None, every_device))):
  sharding = NamedSharding(mesh, spec)
  args = [jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i]) for x in (q, k, v)]
  hlo = step.lower(*args).compile().as_text()
  # Batch and heads stay local; the sequence runs the ring (its hops are collective-permutes).
  assert ("collective-permute" in hlo) == (name == "sequence"), name
  got = [multihost_utils.process_allgather(x, tiled=True) for x in jax.tree.leaves(step(*args))]
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)
  print(f"process {process_id}: {name} ok", flush=True)

jax.distributed.shutdown()
