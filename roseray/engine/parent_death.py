"""A worker process's tie to the process that started it: Linux kills it when that one exits."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent exits


def die_with(parent: int) -> None:
    """Linux: SIGKILL for this process when its parent (pid `parent`) exits, however it exits (a
    killed engine would otherwise leave its workers behind: tensor-parallel ranks waiting in a
    collective and holding their GPUs, grammar workers waiting on a pipe). Elsewhere the parent's
    own stop at exit is all there is."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent went before the prctl took effect
        os._exit(1)
