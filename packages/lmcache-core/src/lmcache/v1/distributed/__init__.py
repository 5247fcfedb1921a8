"""Storage engine: ObjectKey, L1 memory and manager, eviction, controllers, L2 adapters.

See ``storage_manager.StorageManager`` for the entry point the server uses.
"""
