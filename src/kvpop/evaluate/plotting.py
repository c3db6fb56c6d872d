"""PNG figures: matplotlib on the Agg backend, and figures written atomically.

Every command that measures something writes a PNG next to its JSON (``kvpop eval``,
``compare-adapted``, ``diagnose``, ``bench``). matplotlib is imported on first use, not with kvpop:
it costs about half a second and only these writers need it.
"""

from __future__ import annotations

import os
from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` through a temporary file (processes sharing an output folder may
    finish together; a reader never sees half a PNG) and close it."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.png")
    fig.savefig(tmp, dpi=dpi)
    pyplot().close(fig)
    os.replace(tmp, path)
    return path
