"""What a launcher's environment says about this process: torchrun (or any env:// launcher)
sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank it starts. Pure and light
(no torch import), so the CLI can read it on its way out."""
from __future__ import annotations

import os
from collections.abc import Mapping

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def torchrun_rank(environ: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """(rank, world_size) when launched by torchrun (every env:// variable set), else None.

    >>> torchrun_rank({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    (1, 2)
    >>> torchrun_rank({"WORLD_SIZE": "2"}) is None
    True
    """
    if all(k in environ for k in LAUNCH_VARIABLES):
        return int(environ["RANK"]), int(environ["WORLD_SIZE"])
    return None
