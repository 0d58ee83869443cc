"""`python -m bench_client.parent_death PARENT_PID COMMAND...`: exec COMMAND so that it gets
SIGTERM when the sweep process dies, even by kill -9 (Linux prctl PR_SET_PDEATHSIG; elsewhere it
just execs). A wrapper rather than `preexec_fn`, which is unsafe once grpc has started threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit("usage: python -m bench_client.parent_death PARENT_PID COMMAND [ARGS...]")
    parent_pid, command = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
            sys.exit(f"prctl(PR_SET_PDEATHSIG) failed with errno {ctypes.get_errno()}")
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            sys.exit(f"parent {parent_pid} exited before the engine started")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
