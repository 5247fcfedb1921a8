"""Worker-side KV transfer: the two transfer contexts and the mode router.

What each module holds (the layout of LMCache 0.5.6, whose import paths keep working):

    worker_transfer  ``create_transfer_context`` (the router: picks ``lmcache_driven`` or
                     ``engine_driven``; AUTO follows the device spec's
                     ``default_mp_transfer_mode()``), ``TransferContext`` (their shared
                     base), ``LMCacheDrivenTransferContext``, ``EngineDrivenTransferContext``,
                     ``ENV_MP_TRANSFER_MODE``, ``MPTransferMode``
    copy_gate        ``CopyGate`` and ``server_copy_deadline``: nothing writes into KV blocks
                     after the worker stopped waiting for their retrieve (ours)
    base             0.5.6's import path of the paged-KV copy functions
                     (``compute_kv_layout``, ``gather_paged_kv_to_cpu``,
                     ``scatter_cpu_to_paged_kv``); they live in
                     ``lmcache.v1.multiprocess.kv_copy``, shared by the worker's contexts
                     and the server's engine

This package re-exports the public names, as 0.5.6's does, resolved on first use, so that
importing it does not load the worker's contexts (and the client).
"""

from __future__ import annotations

from lmcache.utils.lazy import lazy_attributes, lazy_dir

_WORKER_TRANSFER = "lmcache.v1.multiprocess.transfer_context.worker_transfer"
_KV_COPY = "lmcache.v1.multiprocess.kv_copy"
_LAZY = {
    "EngineDrivenTransferContext": (_WORKER_TRANSFER, "EngineDrivenTransferContext"),
    "LMCacheDrivenTransferContext": (_WORKER_TRANSFER, "LMCacheDrivenTransferContext"),
    "MPTransferMode": (_WORKER_TRANSFER, "MPTransferMode"),
    "TransferContext": (_WORKER_TRANSFER, "TransferContext"),
    "compute_kv_layout": (_KV_COPY, "compute_kv_layout"),
    "create_transfer_context": (_WORKER_TRANSFER, "create_transfer_context"),
    "gather_paged_kv_to_cpu": (_KV_COPY, "gather_paged_kv_to_cpu"),
    "scatter_cpu_to_paged_kv": (_KV_COPY, "scatter_cpu_to_paged_kv"),
}

__all__ = sorted(_LAZY)
__getattr__ = lazy_attributes(__name__, _LAZY)
__dir__ = lazy_dir(globals(), _LAZY)
