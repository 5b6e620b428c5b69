"""Where a loopback worker's engine publishes its KV events: a Unix socket in a directory
only this user can enter, and the sweeping of sockets that killed workers left behind."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import uuid

IPC_PATH_MAX = 100  # a Unix socket path holds at most 107 bytes


def ipc_endpoint(name: str) -> str:
    """An ipc:// endpoint in a directory only this user can enter (created 0700): under
    $XDG_RUNTIME_DIR, else the temporary directory, else /tmp, whichever keeps the socket's
    path short enough. OSError when that directory is not safe."""
    leaf = f"{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}.sock"
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if not base:
            continue
        root = os.path.join(base, f"pdserve-{os.getuid()}")
        if len(root) + 1 + len(leaf) <= IPC_PATH_MAX:
            break
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OSError(f"{root} is not a directory of this user")
    os.chmod(root, 0o700)
    sweep_dead_sockets(root)
    return f"ipc://{root}/{leaf}"


def sweep_dead_sockets(root: str) -> None:
    """Remove sockets left by workers that were killed (their pid is in the name)."""
    for entry in os.scandir(root):
        parts = entry.name.rsplit("-", 2)
        if not entry.name.endswith(".sock") or len(parts) != 3 or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        except PermissionError:  # alive, someone else's
            pass
