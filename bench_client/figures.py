"""matplotlib's pyplot, imported when a figure is first drawn, not when the client starts.

Importing pyplot costs about 0.5 s (0.8 s with the rest of matplotlib: Xeon of family 6 model 207,
2 cores), which every `python -m bench_client` paid before it parsed its arguments: a usage error,
`chat`, or a sweep that writes no plot. Drawing is files only (the Agg backend, chosen before
pyplot is imported), for a client that runs where no display is.
"""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (imported on the first call; later calls return it)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display: set before pyplot is imported
    import matplotlib.pyplot as plt

    return plt
