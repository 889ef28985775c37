"""The per-device cache: tile choices and implementation orders measured on the user's own GPU.

The CUDA kernels compile a few tile shapes per head-dim bucket and pick one
from a table measured on an H100. `python -m jaxflash.tune` re-measures every
candidate on the GPU at hand and writes the winners here; the native calls read
them when they are traced (`_native.tile_attr`, which passes its build id) and
pass them to the kernels as a *preference*: a candidate the running build lacks
falls back to the table (FwdParams::kTilePreferred), so no cache content can
make a call fail.

The file is JSON, by default `$XDG_CACHE_HOME/jaxflash/tiles.json` (or
`~/.cache/...`); `JAXFLASH_TILE_CACHE` names another file, or turns the cache
off with `off` (the test suite does). Each entry records the device kind, the
build it was measured with (a hash of the compiled extension) and the winner of
one (direction, head-dim bucket, causal) cell. Entries of another build are
stale: the candidate lists may have changed, so they are ignored with a
warning that says how to re-measure. A file that cannot be read or parsed is
ignored with a warning too, never an error.

Beside the tile winners (`entries`) the file holds `orders`: which
implementation ran a class of calls fastest on the device (`--orders`; read by
choice.py). The orders shipped with the package (jaxflash/orders.json) are a
file of the same format.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import warnings

FORMAT = 1
ENV = "JAXFLASH_TILE_CACHE"
# ffi/kernels/sm80/launch_sm80.h kHeadDimBuckets: the launchers round a head
# dim up to the next compiled bucket, and the candidates are per bucket.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 192, 256)
DIRECTIONS = ("fwd", "bwd")
# FwdParams::kTilePreferred: a cached index is a preference, not an order.
TILE_PREFERRED = 128
MAX_CANDIDATE = 63


@dataclasses.dataclass(frozen=True)
class Entry:
  """The tile winner of one cell, as stored."""
  device: str
  build: str
  direction: str
  head_dim: int  # the bucket
  causal: bool
  tile: int      # 1-based candidate index
  tflops: float = 0.0
  measured: str = ""

  def cell(self) -> tuple:
    return (self.device, self.direction, self.head_dim, self.causal)

  def valid(self) -> bool:
    return (self.direction in DIRECTIONS and type(self.tile) is int
            and 1 <= self.tile <= MAX_CANDIDATE)


@dataclasses.dataclass(frozen=True)
class Order:
  """The implementations of one class of calls, fastest first, and their times
  (jaxflash/choice.py says what a class is)."""
  device: str
  build: str
  bits: int       # the inputs' dtype width
  head_dim: int   # the bucket
  causal: bool
  queries: str    # "decode", "small" or "train"
  order: tuple[str, ...]
  ms: tuple[float, ...] = ()
  measured: str = ""

  def cell(self) -> tuple:
    return (self.device, self.bits, self.head_dim, self.causal, self.queries)

  def valid(self) -> bool:
    return (self.bits in (16, 32) and self.queries in ("decode", "small", "train") and len(self.order) > 0
            and all(name in IMPLEMENTATIONS for name in self.order)
            and ("xla" not in self.order or self.queries == "small")   # (choice.candidates)
            and all(isinstance(t, (int, float)) for t in self.ms))


# The file's lists, and the record each holds.
KINDS = {"entries": Entry, "orders": Order}
# The implementations an order may name (jaxflash/_core.py's automatic candidates).
IMPLEMENTATIONS = ("native", "pallas", "xla")


def path() -> pathlib.Path | None:
  """The cache file, or None when the cache is turned off."""
  name = os.environ.get(ENV)
  if name is not None:
    return None if name.strip().lower() in ("", "off", "0", "none") else pathlib.Path(name).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "jaxflash" / "tiles.json"


def bucket(head_dim: int) -> int | None:
  """The compiled head-dim bucket a call with this head dim runs in (None: SIMT)."""
  return next((b for b in HEAD_DIM_BUCKETS if head_dim <= b), None)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
  if key not in _warned:
    _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _record(kind: type, raw) -> Entry | Order:
  """One stored record; ValueError for anything malformed."""
  if not isinstance(raw, dict):
    raise ValueError(f"entry {raw!r} is not an object")
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()}
  try:
    record = kind(**fields)
  except TypeError as err:
    raise ValueError(f"entry {raw!r}: {err}") from None
  ok = (isinstance(record.device, str) and isinstance(record.build, str)
        and type(record.head_dim) is int and record.head_dim in HEAD_DIM_BUCKETS
        and type(record.causal) is bool and record.valid())
  if not ok:
    raise ValueError(f"entry {raw!r} has a field out of range")
  return record


def _parse(text: str) -> dict[str, list]:
  """The records of a cache file by list name; ValueError for anything malformed."""
  data = json.loads(text)
  if (not isinstance(data, dict) or data.get("format") != FORMAT
      or not all(isinstance(data.get(name, []), list) for name in KINDS)):
    raise ValueError(f"expected {{'format': {FORMAT}, 'entries': [...], 'orders': [...]}}")
  return {name: [_record(kind, raw) for raw in data.get(name, [])] for name, kind in KINDS.items()}


def read(file: pathlib.Path | None = None, kind: str = "entries") -> list:
  """The cache's tile entries, or with kind="orders" its orders ([] when there is
  none, or with a warning when it is unusable)."""
  file = path() if file is None else file
  if file is None:
    return []
  try:
    stat = file.stat()
  except OSError:
    return []
  return _read_cached(str(file), stat.st_mtime_ns, stat.st_size, stat.st_ino)[kind]


@functools.lru_cache(maxsize=8)
def _read_cached(name: str, mtime_ns: int, size: int, inode: int) -> dict[str, list]:
  del mtime_ns, size, inode  # part of the key: a rewritten (replaced) file is read again
  try:
    return _parse(pathlib.Path(name).read_text())
  except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
    _warn_once(f"bad:{name}", f"jaxflash: ignoring the tile cache {name}: {err}. The built-in tile "
               "table is used; `python -m jaxflash.tune` writes a fresh cache.")
    return {name: [] for name in KINDS}


def lookup(direction: str, head_dim: int, causal: bool, device_kind: str, build) -> int:
  """The tile attribute for a call: 0 (the table) or kTilePreferred + the cached candidate.

  `build()` gives the running extension's id (`_native.build_id`: a hash of the library,
  computed only when the device has entries): entries of another build are stale."""
  b = bucket(head_dim)
  entries = [e for e in read() if e.device == device_kind] if b is not None else []
  if not entries:
    return 0
  current = build()
  fresh = [e for e in entries if e.build == current]
  if not fresh:
    _warn_once(f"stale:{device_kind}", f"jaxflash: the tile cache {path()} was measured for "
               f"{device_kind!r} with another build of jaxflash; it is ignored until "
               "`python -m jaxflash.tune` re-measures it.")
    return 0
  for e in fresh:
    if e.direction == direction and e.head_dim == b and e.causal == bool(causal):
      return TILE_PREFERRED + e.tile
  return 0


def write(new: list, file: pathlib.Path | None = None) -> pathlib.Path:
  """Stores `new` (tile entries, orders or both), replacing the cells it measures
  and every entry of its kind that another build measured on its device."""
  file = path() if file is None else file
  if file is None:
    raise ValueError(f"the tile cache is turned off ({ENV}={os.environ.get(ENV)!r})")
  try:
    old = _parse(file.read_text()) if file.exists() else {}
  except (OSError, ValueError):
    old = {}  # an unusable file is replaced
  stored = {}
  for name, kind in KINDS.items():
    fresh = [r for r in new if isinstance(r, kind)]
    cells = {r.cell() for r in fresh}
    builds = {(r.device, r.build) for r in fresh}
    devices = {r.device for r in fresh}
    kept = [r for r in old.get(name, []) if r.cell() not in cells
            and not (r.device in devices and (r.device, r.build) not in builds)]
    stored[name] = [dataclasses.asdict(r) for r in sorted(kept + fresh, key=lambda r: r.cell())]
  file.parent.mkdir(parents=True, exist_ok=True)
  tmp = file.with_suffix(file.suffix + ".tmp")
  tmp.write_text(json.dumps({"format": FORMAT, **stored}, indent=1) + "\n")
  os.replace(tmp, file)  # readers never see half a file
  return file
