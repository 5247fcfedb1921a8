"""Process state of the torch baseline that tests may need to reset (pin probe)."""

from __future__ import annotations

import sys


def reset_torch_ops_state() -> None:
    # Only if torch_ops was imported: resetting must not import torch.
    mem = sys.modules.get("lmcache.v1.platform.torch_ops._memory")
    if mem is not None:
        mem._reset_pin_state()
