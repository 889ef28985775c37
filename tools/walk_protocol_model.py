"""A model of one CTA of the warp-specialised forward (ffi/kernels/sm90/fwd_ws_kernel.cuh), to
look for deadlocks in its walk over work tiles before a GPU hangs on one.

The producer and each consumer warpgroup are generators that yield the condition they wait on
(an mbarrier phase, a ping-pong turn, a published position) and then do what the kernel does
next: load Q and K/V stages, consume or pass over key tiles, release stages and Q, read and
publish positions in the two work slots. A scheduler runs any agent whose condition holds, in a
random order; a state where none can run while some are not done is a deadlock. Work tiles are
random: empty ones, consumers whose rows see no key, consumers that see a sub-range of the work
tile's key tiles (the others they pass over), with 2-6 stages, one or two Q buffers, O apart or
not, ping-pong or not, two or three consumers. Each consumer must read exactly the positions the
producer published. Three walks:

  static    every gridDim.x-th position on both sides, no slots (the kernels' static walk)
  first     the dynamic walk as first measured: position k + 1 published after tile k's copies
  ahead     as the kernel has it now: k + 1 published as tile k starts, before its copies

    python tools/walk_protocol_model.py [--trials 3000] [--seed 0]

On 2026-11-29 (forty-third session) `first` deadlocked in most configurations, `ahead` and
`static` in none (docs/performance-log.md). A model of the kernel's code, not the kernel: keep
it in step when the roles' order of waits and releases changes.
"""

import argparse
import random


def cta(tiles, stages, q_buffers, separate_o, consumers, ping_pong, walk, rng):
  """Runs one CTA's walk over `tiles` (dicts: keys = the work tile's key tiles, own = each
  consumer's [begin, end) among them); False on a deadlock."""
  # Per barrier, arrivals so far: its k-th phase is done once k times its count have arrived.
  arrived = {name: [0] * n for name, n in (("k_full", stages), ("k_empty", stages), ("v_full", stages),
                                                ("v_empty", stages), ("q_full", q_buffers),
                                                ("q_empty", q_buffers), ("work_full", 2), ("work_empty", 2))}
  slots = [None, None]
  turns = [0] * consumers
  positions = list(range(len(tiles))) + [-1]
  warps = 4 * consumers  # arrivals a stage's empty barrier waits for (one a consumer warp)
  q_arrivals = warps if separate_o else consumers

  def producer():
    ring = q_ring = published = 0

    def publish(at):
      nonlocal published
      if walk == "static":
        return
      s, use = published % 2, published // 2
      yield lambda: arrived["work_empty"][s] >= use * consumers  # every consumer read its last
      slots[s] = at
      arrived["work_full"][s] += 1
      published += 1

    if walk == "ahead":
      yield from publish(positions[0])
    for k, at in enumerate(positions):
      if walk == "ahead" and at >= 0:
        yield from publish(positions[k + 1])
      elif walk == "first":
        yield from publish(at)
      if at < 0:
        return
      tile = tiles[at]
      if tile["keys"] == 0:
        continue
      b, use = q_ring % q_buffers, q_ring // q_buffers
      yield lambda: arrived["q_empty"][b] >= use * q_arrivals
      arrived["q_full"][b] += 1
      q_ring += 1
      for _ in range(tile["keys"]):
        s, use = ring % stages, ring // stages
        yield lambda: arrived["k_empty"][s] >= use * warps
        arrived["k_full"][s] += 1
        yield lambda: arrived["v_empty"][s] >= use * warps
        arrived["v_full"][s] += 1
        ring += 1

  def consumer(c):
    ring = q_ring = taken = turn = 0

    def take():
      nonlocal taken
      taken += 1
      if walk == "static":
        return positions[taken - 1]
      s, use = (taken - 1) % 2, (taken - 1) // 2
      yield lambda: arrived["work_full"][s] >= use + 1
      at = slots[s]
      arrived["work_empty"][s] += 1
      assert at == positions[taken - 1], "a consumer read a position the producer had not published for it"
      return at

    def await_turn():  # turn k of consumer c follows turn k of c - 1 (c = 0: turn k - 1 of the last)
      nonlocal turn
      if ping_pong:
        yield lambda: turns[(c - 1) % consumers] >= turn + (0 if c == 0 else 1)
        turns[c] += 1
        turn += 1

    def full(name, index):
      yield lambda: arrived[name][index % stages] >= index // stages + 1

    def release(name, index):
      arrived[name][index % stages] += 4

    def pass_over():
      nonlocal ring
      yield from full("k_full", ring)
      release("k_empty", ring)
      yield from full("v_full", ring)
      release("v_empty", ring)
      yield from await_turn()
      ring += 1

    at = yield from take()
    while at >= 0:
      tile = tiles[at]
      if tile["keys"] == 0:
        at = yield from take()
        continue
      b, use = q_ring % q_buffers, q_ring // q_buffers
      yield lambda: arrived["q_full"][b] >= use + 1
      q_ring += 1
      begin, end = tile["own"][c]
      if begin < end:
        for _ in range(begin):
          yield from pass_over()
        yield from full("k_full", ring)
        yield from await_turn()
        release("k_empty", ring)
        ring += 1
        for _ in range(begin + 1, end):
          yield from full("k_full", ring)
          yield from full("v_full", ring - 1)
          yield from await_turn()
          release("k_empty", ring)
          release("v_empty", ring - 1)
          ring += 1
        if separate_o:
          arrived["q_empty"][b] += 4
        yield from full("v_full", ring - 1)
        next_at = yield from take()  # read before the last P·V is issued
        yield from await_turn()
        release("v_empty", ring - 1)
        rest = tile["keys"] - end
      else:
        if separate_o:
          arrived["q_empty"][b] += 4
        yield from await_turn()
        next_at = yield from take()
        rest = tile["keys"]
      for _ in range(rest):
        yield from pass_over()
      if not separate_o:
        arrived["q_empty"][b] += 1  # the epilogue
      at = next_at

  agents = [producer()] + [consumer(c) for c in range(consumers)]
  waiting = [None] * len(agents)
  finished = [False] * len(agents)

  def advance(i):
    try:
      waiting[i] = next(agents[i])
    except StopIteration:
      finished[i] = True

  for i in range(len(agents)):
    advance(i)
  while not all(finished):
    ready = [i for i in range(len(agents)) if not finished[i] and waiting[i]()]
    if not ready:
      return False
    advance(rng.choice(ready))
  return True


def random_tiles(rng, count, consumers, most_keys):
  tiles = []
  for _ in range(count):
    keys = rng.choice([0] + list(range(1, most_keys + 1)))
    own = []
    for _ in range(consumers):
      if keys == 0 or rng.random() < 0.2:
        own.append((0, 0))  # this consumer's rows see no key
      else:
        begin = rng.randrange(keys)
        own.append((begin, rng.randrange(begin + 1, keys + 1)))
    tiles.append(dict(keys=keys, own=own))
  return tiles


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--trials", type=int, default=3000)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  for walk in ("static", "first", "ahead"):
    rng = random.Random(args.seed)
    deadlocks = 0
    for _ in range(args.trials):
      q_buffers = rng.choice([1, 2])
      config = dict(stages=rng.choice([2, 4, 6]), q_buffers=q_buffers,
                    separate_o=q_buffers == 2 or rng.random() < 0.5, consumers=rng.choice([2, 3]),
                    ping_pong=rng.random() < 0.5)
      tiles = random_tiles(rng, rng.randint(1, 10), config["consumers"], 14)
      deadlocks += not cta(tiles, walk=walk, rng=random.Random(rng.random()), **config)
    print(f"{walk:7s} deadlocked in {deadlocks} of {args.trials} random CTAs")


if __name__ == "__main__":
  main()
