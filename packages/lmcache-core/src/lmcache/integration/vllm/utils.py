"""Small helpers vLLM's own LMCache connector imports from this module."""

from __future__ import annotations

from typing import Any


def mla_enabled(model_config: Any) -> bool:
    """True when the model uses multi-head latent attention (one KV plane, replicated over TP).

    vLLM's ``ModelConfig`` exposes this as ``use_mla``; a missing config or attribute means no MLA.
    """
    if model_config is None:
        return False
    return bool(getattr(model_config, "use_mla", False))
