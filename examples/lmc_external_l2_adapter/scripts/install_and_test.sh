#!/usr/bin/env bash
# The four verification steps of the L2 plugin guide. Run from the repository root.
set -euo pipefail
PYTHON="${PYTHON:-python}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# 1. install the plugin (editable; lmcache-core must already be installed)
"$PYTHON" -m pip install --no-deps -e "$HERE"
# 2. the module imports
"$PYTHON" -c "from lmc_external_l2_adapter import InMemoryL2Adapter; print(InMemoryL2Adapter)"
# 3. lmcache knows the plugin type
"$PYTHON" -c "from lmcache.v1.distributed.l2_adapters.config import get_registered_l2_adapter_types
print(get_registered_l2_adapter_types())"
# 4. the plugin's own tests
"$PYTHON" -m pytest "$HERE/tests/" -v
