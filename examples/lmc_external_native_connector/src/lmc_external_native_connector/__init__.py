"""Example external native connector for lmcache's ``native_plugin`` L2 type.

--l2-adapter '{"type":"native_plugin","module_path":"lmc_external_native_connector",
               "class_name":"ExampleNativeConnector",
               "adapter_params":{"backend":"fs","base_path":"/data/lmcache_ext","num_workers":2}}'
"""

from lmc_external_native_connector.connector import (
    ExampleFSConnector,
    ExampleMemoryConnector,
    ExampleNativeConnector,
)

__all__ = ["ExampleFSConnector", "ExampleMemoryConnector", "ExampleNativeConnector"]
