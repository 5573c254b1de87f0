"""Tests that need vLLM itself: collected only by ``python -m harness selftest``.

They run in the harness venv, where the built wheel is installed (``nox -s
test`` runs them after the series' tests). The ``harness`` nox session's venv
has no vLLM, so there this directory is not collected at all; under
``selftest`` (``HARNESS_WHEEL_TESTS=1``) a missing vLLM is an import error,
never a skip.
"""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("HARNESS_WHEEL_TESTS") == "1" else ["test_*.py"]
