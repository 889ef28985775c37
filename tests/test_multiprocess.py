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


def test_sharded_calls_across_two_processes_equal_one_device(tmp_path):
  port = free_port()
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  # Output to files, not pipes: a full pipe would block one process while the
  # other waits for it in a collective.
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
           for i, log in enumerate(logs)]
  try:
    for p in procs:
      p.wait(timeout=600)
  finally:
    for p in procs:
      p.kill()
  outputs = [log.read_text() for log in logs]
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
    for name in ("batch", "heads", "sequence"):
      assert f"process {i}: {name} ok" in out, out[-4000:]
