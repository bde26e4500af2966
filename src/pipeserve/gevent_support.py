"""Whether gevent's monkey patching is active, without importing gevent."""

from __future__ import annotations

import sys


def gevent_patched(module: str = "threading") -> bool:
    """True when gevent monkey patching replaced `module` in this process."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched(module))
