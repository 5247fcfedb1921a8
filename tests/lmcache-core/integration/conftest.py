"""Fixtures of the vLLM connector tests: the harness module and a real ``lmcache server``."""

from __future__ import annotations

import os
import sys

# The harness lives next to the tests (importlib import mode: put this folder on the path).
sys.path.insert(0, os.path.dirname(__file__))
