"""Run the specstack CLI with bf16 products of TILES_FROM rows and more kept off the AMX tiles (the streaming
kernel up to six rows, oneDNN beyond), to measure what the tiles change: for example

    python examples/paper/without_tiles.py bench --grid examples/paper/tiles_bf16.toml --out results/no_tiles
"""

import sys

import attrs

import specstack.packed_linear as packed_linear
from specstack.cli import main

with_tiles = packed_linear.load_rows_kernel


def load_rows_kernel_without_tiles(cache=None):
    kernel = with_tiles(cache)
    return None if kernel is None else attrs.evolve(kernel, tiles=False)


if __name__ == "__main__":
    packed_linear.load_rows_kernel = load_rows_kernel_without_tiles
    sys.exit(main(sys.argv[1:]))
