"""The tile sweep's former command, kept for the commands quoted in docs/performance-log.md.

`python tools/tune_tiles.py ARGS` runs `python -m jaxflash.tune --direction fwd --no-write ARGS`
(its old defaults: forward only, nothing written to the tile cache).
"""

import sys

from jaxflash.tune import main

if __name__ == "__main__":
  main(["--direction", "fwd", "--no-write", *sys.argv[1:]])
