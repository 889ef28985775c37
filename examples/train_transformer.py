"""Train a small decoder-only transformer (Flax NNX) with jaxflash and with jax.nn attention.

Both runs use the same seed, data order and initial parameters; only the
attention function differs. The script prints both loss curves and the step
times, writes a PNG of the curves (when matplotlib is importable), and checks
that a checkpoint saved from the jax.nn model loads into the jaxflash model
(and back) and gives the same outputs.

The text is generated deterministically (character level), so nothing is
downloaded. CPU-sized defaults:

    python examples/train_transformer.py --steps 300

A GPU measurement at long sequence length:

    python examples/train_transformer.py --steps 100 --seq-len 8192 --batch 2 \
        --d-model 1024 --layers 4 --heads 16 --kv-heads 4 --dtype bfloat16 \
        --baseline-implementation cudnn

Data x sequence parallel on a mesh of devices (here 2 x 4; on the CPU,
XLA_FLAGS=--xla_force_host_platform_device_count=8 makes 8 devices):

    python examples/train_transformer.py --mesh 2x4 --steps 50

The batch is split over the first mesh axis and the sequence over the second;
parameters are replicated. Nothing in the model changes: jaxflash's partition
rules see sequence-sharded queries and keys and run ring attention.

Packed sequences (segment ids): with --pack K every row of seq-len tokens
holds K documents of random length, marked with segment ids (attention stays
inside a document, positions restart at each); the same documents are also
trained one per row, padded. Both runs see the same tokens and the same
targets (a document's last token predicts nothing), so their losses agree
step by step, while the packed rows waste no compute on padding:

    python examples/train_transformer.py --pack 4 --steps 100
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, serialization
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxflash.flax

# ------------------------------------------------------------------ data

_NAMES = ["ada", "bob", "cyd", "dee", "eli", "fay", "gus", "hal", "ivy", "jon", "kim", "lou"]
_THINGS = ["apples", "books", "coins", "drums", "eggs", "figs", "gems", "hats", "keys", "maps"]
_VERBS = ["gives", "sends", "lends", "shows", "sells"]
_ADJ = ["red", "old", "small", "heavy", "shiny", "odd", "blue", "quiet"]


def make_corpus(n_chars: int, seed: int = 0) -> str:
  """Deterministic synthetic text with short- and long-range structure.

  Three kinds of line: simple sentences from a small grammar, additions with
  their results, and "recall" lines that repeat a name given earlier on the
  line (so attention to a far position pays off).
  """
  rng = np.random.default_rng(seed)
  parts, size = [], 0
  while size < n_chars:
    kind = rng.integers(3)
    if kind == 0:
      a, b = rng.choice(_NAMES, 2, replace=False)
      line = (f"{a} {rng.choice(_VERBS)} {b} {rng.integers(2, 10)} {rng.choice(_ADJ)} "
              f"{rng.choice(_THINGS)}.")
    elif kind == 1:
      a, b = rng.integers(0, 100, 2)
      line = f"{a}+{b}={a + b}."
    else:
      who = rng.choice(_NAMES)
      filler = " ".join(rng.choice(_ADJ, rng.integers(2, 6)))
      line = f"remember {who}, {filler}, then say {who}."
    parts.append(line + "\n")
    size += len(line) + 1
  return "".join(parts)[:n_chars]


class CharData:
  """Character vocabulary and a deterministic batch sampler."""

  def __init__(self, text: str):
    self.chars = sorted(set(text))
    self.index = {c: i for i, c in enumerate(self.chars)}
    self.tokens = np.array([self.index[c] for c in text], np.int32)

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def batches(self, batch: int, seq_len: int, seed: int):
    rng = np.random.default_rng(seed)
    span = seq_len + 1
    if len(self.tokens) < span:
      raise ValueError(f"corpus of {len(self.tokens)} tokens is shorter than seq_len + 1")
    while True:
      starts = rng.integers(0, len(self.tokens) - span + 1, batch)
      chunk = np.stack([self.tokens[s:s + span] for s in starts])
      yield chunk[:, :-1], chunk[:, 1:]

  def packed_batches(self, batch: int, seq_len: int, documents: int, seed: int):
    """Rows of `documents` documents of random length, two ways per step.

    Yields (packed, unpacked), each a dict of x, y (tokens, next tokens), weights
    (1 where a token's target lies in its own document), positions (within the
    document) and, packed, segment ids. Packed: [batch, seq_len]. Unpacked: one
    document per row, [batch * documents, seq_len], padded after the document
    with weight 0 (causal attention keeps the padding out of the document).
    """
    rng = np.random.default_rng(seed)
    for x, y in self.batches(batch, seq_len, seed):
      cuts = np.sort(np.stack([rng.choice(np.arange(1, seq_len), documents - 1, replace=False)
                               for _ in range(batch)]), axis=1)
      ids = (np.arange(seq_len)[None, None] >= cuts[:, :, None]).sum(1).astype(np.int32)
      starts = np.concatenate([np.zeros((batch, 1), int), cuts], axis=1)   # [batch, documents]
      positions = np.arange(seq_len)[None] - np.take_along_axis(starts, ids, axis=1)
      last = np.concatenate([ids[:, 1:] != ids[:, :-1], np.ones((batch, 1), bool)], axis=1)
      weights = (~last).astype(np.float32)
      packed = dict(x=x, y=y, weights=weights, positions=positions.astype(np.int32), segment_ids=ids)
      ends = np.concatenate([cuts, np.full((batch, 1), seq_len)], axis=1)
      rows = {k: np.zeros((batch * documents, seq_len), v.dtype) for k, v in packed.items()
              if k != "segment_ids"}
      for b in range(batch):
        for d in range(documents):
          a, e = starts[b, d], ends[b, d]
          for k in rows:
            rows[k][b * documents + d, :e - a] = packed[k][b, a:e]
      yield packed, rows


# ------------------------------------------------------------------ model

@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 64
  seq_len: int = 128
  d_model: int = 128
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  mlp_ratio: int = 4
  dtype: str = "float32"
  batch: int = 16
  steps: int = 300
  lr: float = 3e-3
  warmup: int = 20
  seed: int = 0
  implementation: str | None = None            # jaxflash's (None: fastest available)
  baseline_implementation: str | None = None   # jax.nn's (None, "xla", "cudnn")


def jax_nn_attention(implementation: str | None = None):
  """An nnx attention_fn that calls jax.nn.dot_product_attention (the baseline)."""

  def attention_fn(query, key, value, bias=None, mask=None, *, is_causal=False, dtype=None,
                   dropout_rate=0.0, deterministic=True, module=None, **unused):
    assert not dropout_rate and module is None
    if dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal,
                                        implementation=implementation)

  return attention_fn


class Block(nnx.Module):
  """Pre-norm block: RMSNorm → causal GQA attention → RMSNorm → GELU MLP."""

  def __init__(self, cfg: Config, attention: str, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.norm1 = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    common = dict(num_heads=cfg.heads, in_features=cfg.d_model, num_kv_heads=cfg.kv_heads,
                  use_bias=False, decode=False, dtype=dtype, rngs=rngs)
    if attention == "jaxflash":
      self.attn = jaxflash.flax.MultiHeadAttention(
          **common, is_causal=True, implementation=cfg.implementation)
    elif attention == "jax":
      self.attn = nnx.MultiHeadAttention(
          **common, attention_fn=jax_nn_attention(cfg.baseline_implementation))
    else:
      raise ValueError(f"attention must be 'jaxflash' or 'jax', got {attention!r}")
    self.norm2 = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    hidden = cfg.mlp_ratio * cfg.d_model
    self.up = nnx.Linear(cfg.d_model, hidden, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(hidden, cfg.d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x, segment_ids=None):
    # Segment ids (packed documents) reach only jaxflash's layer; jax.nn takes none.
    ids = {} if segment_ids is None else dict(query_segment_ids=segment_ids)
    x = x + self.attn(self.norm1(x), is_causal=True, **ids)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
  """Decoder-only character model with learned positions."""

  def __init__(self, cfg: Config, attention: str, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
    self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, attention, rngs=rngs) for _ in range(cfg.layers)])
    self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, positions=None, segment_ids=None):
    positions = jnp.arange(tokens.shape[-1]) if positions is None else positions
    x = self.embed(tokens) + self.pos(positions)
    for block in self.blocks:
      x = block(x, segment_ids)
    return self.head(self.norm(x)).astype(jnp.float32)


def loss_fn(model, x, y, weights=None, positions=None, segment_ids=None):
  """Mean cross-entropy over the tokens of weight 1 (all of them without weights)."""
  losses = optax.softmax_cross_entropy_with_integer_labels(model(x, positions, segment_ids), y)
  if weights is None:
    return losses.mean()
  return (losses * weights).sum() / weights.sum()


@nnx.jit
def train_step(model, optimizer, x, y, weights=None, positions=None, segment_ids=None):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y, weights, positions, segment_ids)
  optimizer.update(model, grads)
  return loss


def make_optimizer(model, cfg: Config):
  schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(1, cfg.warmup),
                                                max(cfg.steps, cfg.warmup + 1), cfg.lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def make_mesh(spec: str):
  """'DxS' -> a (data, seq) mesh of D * S devices, or None for ''."""
  if not spec:
    return None
  try:
    data, seq = (int(n) for n in spec.lower().split("x"))
  except ValueError:
    raise SystemExit(f"--mesh must look like 2x4 (data x sequence), got {spec!r}")
  if data * seq > jax.device_count():
    raise SystemExit(f"--mesh {spec} needs {data * seq} devices, {jax.device_count()} visible")
  return jax.make_mesh((data, seq), ("data", "seq"), devices=jax.devices()[:data * seq],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def place(mesh, tree, spec=P()):
  """Put arrays on the mesh (replicated by default); unchanged without a mesh."""
  return tree if mesh is None else jax.device_put(tree, NamedSharding(mesh, spec))


def train(cfg: Config, attention: str, data: CharData, log_every: int = 0, mesh=None):
  """Train from the seed; return (model, losses, step_times).

  With a mesh, tokens are split [batch over "data", sequence over "seq"] and
  the parameters and optimizer state replicated.
  """
  model = Transformer(cfg, attention, rngs=nnx.Rngs(cfg.seed))
  nnx.update(model, place(mesh, nnx.state(model)))
  optimizer = make_optimizer(model, cfg)
  nnx.update(optimizer, place(mesh, nnx.state(optimizer)))
  batches = data.batches(cfg.batch, cfg.seq_len, cfg.seed)
  losses, times = [], []
  for step in range(cfg.steps):
    x, y = (place(mesh, jnp.asarray(t), P("data", "seq")) for t in next(batches))
    t0 = time.perf_counter()
    loss = float(train_step(model, optimizer, x, y))   # blocks
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    if log_every and (step % log_every == 0 or step == cfg.steps - 1):
      print(f"  [{attention:8s}] step {step:5d}  loss {loss:.4f}  {times[-1] * 1e3:8.1f} ms",
            flush=True)
  return model, np.array(losses), np.array(times)


def train_packed(cfg: Config, data: CharData, documents: int, log_every: int = 0):
  """jaxflash from one seed on the same documents, packed with segment ids and one
  per padded row; returns {"packed": (losses, times), "unpacked": (losses, times)}."""
  results = {}
  for way in ("packed", "unpacked"):
    model = Transformer(cfg, "jaxflash", rngs=nnx.Rngs(cfg.seed))
    optimizer = make_optimizer(model, cfg)
    batches = data.packed_batches(cfg.batch, cfg.seq_len, documents, cfg.seed)
    losses, times = [], []
    for step in range(cfg.steps):
      batch = {k: jnp.asarray(v) for k, v in next(batches)[way == "unpacked"].items()}
      t0 = time.perf_counter()
      losses.append(float(train_step(model, optimizer, **batch)))
      times.append(time.perf_counter() - t0)
      if log_every and (step % log_every == 0 or step == cfg.steps - 1):
        print(f"  [{way:8s}] step {step:5d}  loss {losses[-1]:.4f}  {times[-1] * 1e3:8.1f} ms",
              flush=True)
    results[way] = (np.array(losses), np.array(times))
  return results


# ------------------------------------------------------------------ checkpoints

def save_params(model: nnx.Module, path: str) -> None:
  """Parameters as a plain nested dict of arrays (msgpack): nothing jaxflash-specific."""
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  pure = jax.tree.map(np.asarray, pure)
  with open(path, "wb") as f:
    f.write(serialization.msgpack_serialize(_str_keys(pure)))


def load_params(model: nnx.Module, path: str) -> None:
  with open(path, "rb") as f:
    pure = serialization.msgpack_restore(f.read())
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, _match_keys(pure, nnx.to_pure_dict(state)))
  nnx.update(model, state)


def _str_keys(tree):
  return {str(k): _str_keys(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _match_keys(loaded, like):
  """Restore the key types (ints for list entries) of `like` in `loaded`."""
  if not isinstance(like, dict):
    return loaded
  return {k: _match_keys(loaded[str(k)], v) for k, v in like.items()}


def checkpoint_round_trip(model_jax: nnx.Module, cfg: Config, x, directory: str) -> dict:
  """jax.nn model → file → fresh jaxflash model (and back); compare their outputs."""
  path = os.path.join(directory, "params_jax_nn.msgpack")
  save_params(model_jax, path)
  model_flash = Transformer(cfg, "jaxflash", rngs=nnx.Rngs(cfg.seed + 1))   # different init
  load_params(model_flash, path)
  ref = model_jax(x)
  out = model_flash(x)
  back_path = os.path.join(directory, "params_jaxflash.msgpack")
  save_params(model_flash, back_path)
  model_back = Transformer(cfg, "jax", rngs=nnx.Rngs(cfg.seed + 2))
  load_params(model_back, back_path)
  same_bytes = open(path, "rb").read() == open(back_path, "rb").read()
  return dict(max_abs_logit_diff=float(jnp.max(jnp.abs(out - ref))),
              max_abs_logit_back=float(jnp.max(jnp.abs(model_back(x) - ref))),
              identical_files=same_bytes,
              logit_scale=float(jnp.max(jnp.abs(ref))))


# ------------------------------------------------------------------ report

def plot(losses: dict, path: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not importable: no plot written")
    return False
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, curve in losses.items():
    ax.plot(np.arange(len(curve)), curve, label=name, lw=1.2, alpha=0.8)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats / char)")
  ax.set_title("Same model, same seed: jaxflash vs jax.nn attention")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def summarize_times(times: np.ndarray, tokens_per_step: int) -> dict:
  steady = times[min(2, len(times) - 1):]   # the first steps compile
  median = float(np.median(steady))
  return dict(compile_s=float(times[0]), median_ms=median * 1e3,
              tokens_per_s=tokens_per_step / median)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--warmup", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--implementation", default=None,
                 help="jaxflash implementation (native, pallas, xla; default: fastest)")
  p.add_argument("--baseline-implementation", default=None,
                 help="jax.nn implementation (xla, cudnn; default: jax's choice)")
  p.add_argument("--attention", default="both", choices=["both", "jaxflash", "jax"])
  p.add_argument("--log-every", type=int, default=25)
  p.add_argument("--plot", default="train_transformer_loss.png",
                 help="PNG path for the loss curves ('' for none)")
  p.add_argument("--corpus-chars", type=int, default=0,
                 help="size of the generated text (default: enough for the batch shape)")
  p.add_argument("--pack", type=int, default=0, metavar="K",
                 help="pack K documents of random length per row with segment ids and compare "
                      "with the same documents one per padded row (jaxflash both times)")
  p.add_argument("--mesh", default="",
                 help="DxS: data parallel over D devices x sequence parallel over S (ring "
                      "attention); default: one device")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  n_chars = args.corpus_chars or max(400_000, 20 * args.seq_len)
  data = CharData(make_corpus(n_chars, seed=1234))
  cfg = Config(vocab_size=data.vocab_size, seq_len=args.seq_len, d_model=args.d_model,
               layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, dtype=args.dtype,
               batch=args.batch, steps=args.steps, lr=args.lr, warmup=args.warmup,
               seed=args.seed, implementation=args.implementation,
               baseline_implementation=args.baseline_implementation)
  print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); "
        f"{len(data.tokens)} chars, vocab {data.vocab_size}")
  print(f"model: {cfg.layers} layers, d_model {cfg.d_model}, heads {cfg.heads} "
        f"(kv {cfg.kv_heads}), {cfg.dtype}; batch {cfg.batch} x {cfg.seq_len}, {cfg.steps} steps")

  if args.pack:
    if not 1 < args.pack < cfg.seq_len:
      raise SystemExit(f"--pack must be in [2, seq-len), got {args.pack}")
    runs = train_packed(cfg, data, args.pack, log_every=args.log_every)
    (packed, t_packed), (unpacked, t_unpacked) = runs["packed"], runs["unpacked"]
    diff = np.abs(packed - unpacked)
    sp, su = summarize_times(t_packed, cfg.batch * cfg.seq_len), summarize_times(
        t_unpacked, cfg.batch * args.pack * cfg.seq_len)
    print(f"\npacked ({args.pack} documents a row, segment ids) vs one document a padded row: "
          f"max |loss diff| {diff.max():.3e} over {cfg.steps} steps (max relative "
          f"{(diff / unpacked).max():.3e}); final losses {packed[-1]:.4f} vs {unpacked[-1]:.4f}")
    print(f"step times: packed {sp['median_ms']:.2f} ms, unpacked {su['median_ms']:.2f} ms "
          f"({args.pack}x the rows)")
    return 0

  mesh = make_mesh(args.mesh)
  if mesh is not None:
    if cfg.batch % mesh.shape["data"] or cfg.seq_len % mesh.shape["seq"]:
      raise SystemExit(f"--mesh {args.mesh}: batch {cfg.batch} and seq-len {cfg.seq_len} must "
                       "divide by the data and sequence axes")
    print(f"mesh: data {mesh.shape['data']} x seq {mesh.shape['seq']} devices")
  names = {"jaxflash": "jaxflash", "jax": "jax.nn"}
  which = ["jaxflash", "jax"] if args.attention == "both" else [args.attention]
  models, losses, times = {}, {}, {}
  for attention in which:
    print(f"training with {names[attention]} attention")
    models[attention], losses[attention], times[attention] = train(
        cfg, attention, data, log_every=args.log_every, mesh=mesh)

  tokens = cfg.batch * cfg.seq_len
  print("\nloss curves (every --log-every steps):")
  header = "  step " + "".join(f"{names[a]:>12s}" for a in which)
  print(header + ("    |diff|" if len(which) == 2 else ""))
  every = max(1, args.log_every)
  for step in list(range(0, cfg.steps, every)) + ([cfg.steps - 1] if (cfg.steps - 1) % every
                                                   else []):
    row = f"  {step:5d}" + "".join(f"{losses[a][step]:12.4f}" for a in which)
    if len(which) == 2:
      row += f"  {abs(losses['jaxflash'][step] - losses['jax'][step]):8.2e}"
    print(row)

  print("\nstep times (first step includes compilation):")
  for a in which:
    t = summarize_times(times[a], tokens)
    print(f"  {names[a]:9s} compile+first {t['compile_s']:7.2f} s   median {t['median_ms']:9.2f} "
          f"ms/step   {t['tokens_per_s']:12.0f} tokens/s")
  if len(which) == 2:
    diff = np.abs(losses["jaxflash"] - losses["jax"])
    rel = diff / np.abs(losses["jax"])
    sj, sx = summarize_times(times["jaxflash"], tokens), summarize_times(times["jax"], tokens)
    print(f"  speed-up jaxflash / jax.nn: {sx['median_ms'] / sj['median_ms']:.2f}x")
    print(f"\nmax |loss diff| {diff.max():.3e} (max relative {rel.max():.3e}); final losses "
          f"{losses['jaxflash'][-1]:.4f} (jaxflash) vs {losses['jax'][-1]:.4f} (jax.nn)")

  if args.plot:
    if plot({names[a]: losses[a] for a in which}, args.plot):
      print(f"plot written to {args.plot}")

  if "jax" in models:
    x, _ = next(data.batches(min(cfg.batch, 4), cfg.seq_len, cfg.seed + 99))
    with tempfile.TemporaryDirectory() as d:
      rt = checkpoint_round_trip(models["jax"], cfg, jnp.asarray(x), d)
    print(f"\ncheckpoint: jax.nn params -> jaxflash model: max |logit diff| "
          f"{rt['max_abs_logit_diff']:.3e} (logits up to {rt['logit_scale']:.1f}); "
          f"saved back from jaxflash and reloaded into jax.nn: {rt['max_abs_logit_back']:.3e}; "
          f"the two checkpoint files are byte-identical: {rt['identical_files']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
