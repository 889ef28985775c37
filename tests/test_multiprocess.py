"""A multi-process JAX program: the partition rules across processes, as on several hosts.

Two processes with 4 host devices each (jax.distributed on localhost, gloo
collectives) run batch-, head- and sequence-sharded calls, forward and
gradients, and compare them with a one-device run (multiprocess_worker.py).
"""

from __future__ import annotations

import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_sharded_calls_across_two_processes_equal_one_device():
  port = free_port()
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  try:
    outputs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    for name in ("batch", "heads", "sequence"):
      assert f"process {i}: {name} ok" in out, out[-4000:]
