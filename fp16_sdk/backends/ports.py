"""A TCP port free on this machine a moment ago: the rendezvous port of a job whose hosts all
run here (local_process, and local Docker on the host network), so two jobs never share one."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listened on when asked (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
