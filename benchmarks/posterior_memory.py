"""Peak memory of ``ContextPosterior.fit`` on N streamed inputs (one process).

Usage: ``python benchmarks/posterior_memory.py N [batch_size]``; prints
``N=<N> max_rss_mib=<peak resident set size> fit_s=<seconds>``. The inputs are
generated on the fly by an ``IterableDataset`` (never held all at once), so the
peak should not grow with ``N``; run it for two values of ``N`` in separate
processes and compare (``tests/context/test_posterior_memory.py`` does).
"""

from __future__ import annotations

import resource
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from laplace_diffjac.context import ContextPosterior


class GeneratedRegression(IterableDataset):
    """``n`` pairs ``(x, sin(x).sum())`` made chunk by chunk from a seed."""

    def __init__(self, n: int, chunk: int = 1024) -> None:
        self.n, self.chunk = n, chunk

    def __iter__(self):
        for start in range(0, self.n, self.chunk):
            gen = torch.Generator().manual_seed(start)
            size = min(self.chunk, self.n - start)
            x = torch.randn((size, 8), generator=gen, dtype=torch.float64)
            yield from zip(x, torch.sin(x).sum(1, keepdim=True))


def main(n: int, batch_size: int = 512) -> None:
    """Fit on ``n`` generated points and print the peak resident memory."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)).double()
    locations = torch.randn(64, 8, dtype=torch.float64)
    loader = DataLoader(GeneratedRegression(n), batch_size=batch_size)
    start = time.perf_counter()
    la = ContextPosterior(model, "regression", locations).fit(loader)
    seconds = time.perf_counter() - start
    assert la.n_data == n
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(f"N={n} max_rss_mib={peak_kib / 1024:.1f} fit_s={seconds:.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
