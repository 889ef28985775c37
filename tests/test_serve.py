"""examples/serve.py, short: token-by-token generation from a contiguous and a
paged KV cache must reproduce the no-cache forward's logits and agree on the text."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

SERVE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "serve.py"


@pytest.fixture(scope="module")
def serve():
  spec = importlib.util.spec_from_file_location("serve_example", SERVE)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod
  try:
    spec.loader.exec_module(mod)
    yield mod
  finally:
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("dtype,page_size", [("float32", 16), ("bfloat16", 5)])
def test_serving_matches_the_no_cache_forward(serve, capsys, dtype, page_size):
  argv = ["--train-steps", "3", "--seq-len", "32", "--prompt-len", "7", "--new-tokens", "12",
          "--batch", "3", "--d-model", "32", "--heads", "4", "--kv-heads", "2", "--dtype", dtype,
          "--page-size", str(page_size)]
  assert serve.main(argv) == 0
  out = capsys.readouterr().out
  assert out.count(" ok") == 2 and "generate the same tokens: True" in out, out
  assert "tokens/s" in out
