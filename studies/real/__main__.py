"""``python -m studies.real``: see :mod:`studies.real.run`."""

from .run import main

main()
