"""``python -m benchmarks.real``: see :mod:`benchmarks.real.run`."""

from .run import main

main()
