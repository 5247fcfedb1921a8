#!/usr/bin/env bash
# Install the example and run its tests (from the repository root).
set -euo pipefail
python -m pip install --no-deps --no-build-isolation ./examples/lmc_external_native_connector
python -c "from lmc_external_native_connector import ExampleNativeConnector; print(ExampleNativeConnector)"
python -c "from lmcache.v1.distributed.l2_adapters.config import get_registered_l2_adapter_types as t; assert 'native_plugin' in t(), t()"
python -m pytest tests/examples/lmc_external_native_connector -q
