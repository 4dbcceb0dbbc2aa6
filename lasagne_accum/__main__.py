"""``python -m lasagne_accum``: the report a bug report asks for (:func:`show_config`).

Exit status 0, or 3 when a warning was printed (the C backend's BLAS runs a
generic kernel, is much slower than Numba's, or is missing): the README's
set-up uses it to decide whether PyTensor needs another BLAS.
"""

import argparse
import sys

from .machine import show_config


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m lasagne_accum",
        description="Print PyTensor's version, the BLAS and kernel of each backend, the "
                    "modes default_modes() picked and why, and the JAX and PyTorch devices.")
    parser.parse_args(argv)
    return 3 if show_config() else 0


if __name__ == "__main__":
    sys.exit(main())
