"""The network tests' one rule: skip when PyPI cannot be reached, unless VLLMHOTFIX_REQUIRE_NETWORK
is set (scripts/test.sh sets it), then fail, so that CI always checks what PyPI has now."""

from __future__ import annotations

import os

import pytest

REQUIRE_NETWORK_VAR = "VLLMHOTFIX_REQUIRE_NETWORK"


def network_unavailable(message: str) -> None:
    """Skip, or fail when VLLMHOTFIX_REQUIRE_NETWORK asks for the network tests to run."""
    if os.environ.get(REQUIRE_NETWORK_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
        pytest.fail(f"{message} ({REQUIRE_NETWORK_VAR} is set: network tests must run; set it to 0 offline)")
    pytest.skip(message)
