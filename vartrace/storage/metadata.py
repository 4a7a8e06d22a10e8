"""What a run file records about the run that wrote it (``/meta``).

:func:`collect_metadata` gathers the command line, working directory, host,
versions, installed packages, git state, world size, start time and an
allow-listed set of environment variables.  Secrets stay out: environment
variables whose names look secret are never recorded even when allow-listed,
and command-line values given to secret-looking options are redacted.

Example::

    meta = collect_metadata(world_size=4)
    meta["git"].get("commit"), meta["env"].get("CUDA_VISIBLE_DEVICES")
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
from typing import Any

__all__ = ["ENV_NAMES", "ENV_PREFIXES", "collect_metadata", "looks_secret"]

ENV_NAMES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "PYTHONHASHSEED",
        "PYTHONOPTIMIZE",
        "CONDA_DEFAULT_ENV",
        "VIRTUAL_ENV",
    }
)
ENV_PREFIXES = (
    "CUDA_",
    "CUBLAS_",
    "CUDNN_",
    "NCCL_",
    "TORCH_",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "SLURM_",
    "VARTRACE_",
)
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|COOKIE|PRIVATE", re.I)
_DIFF_LIMIT = 1 << 20
_GIT_TIMEOUT_S = 10.0


def looks_secret(name: str) -> bool:
    """Whether a variable or option name looks like it holds a secret.

    Example: ``looks_secret("HF_TOKEN") and not looks_secret("OMP_NUM_THREADS")``.
    """
    return _SECRET.search(name) is not None


def _environment() -> dict[str, str]:
    return {
        name: value
        for name, value in sorted(os.environ.items())
        if (name in ENV_NAMES or name.startswith(ENV_PREFIXES)) and not looks_secret(name)
    }


def _command_line() -> list[str]:
    """``sys.argv`` with the values of secret-looking options replaced."""
    redacted: list[str] = []
    hide_next = False
    for argument in sys.argv:
        option, equals, _ = argument.partition("=")
        if hide_next:
            redacted.append("<redacted>")
        elif argument.startswith("-") and equals and looks_secret(option):
            redacted.append(f"{option}=<redacted>")
        else:
            redacted.append(argument)
        hide_next = argument.startswith("-") and not equals and looks_secret(argument)
    return redacted


def _git(*args: str, where: str | None = None) -> bytes | None:
    try:
        done = subprocess.run(
            ["git", *(["-C", where] if where else []), *args],
            capture_output=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _text(raw: bytes | None) -> str:
    """Git output as text, cut to the size limit."""
    return (raw or b"")[:_DIFF_LIMIT].decode("utf-8", "replace")


def _script_directory() -> str | None:
    """The directory of the running script (``python path/train.py``), if there is one."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.dirname(os.path.abspath(script)) if script else None


def _git_state() -> dict[str, Any]:
    """Git state of the running script's repository, else of the working directory's."""
    for where in dict.fromkeys((_script_directory(), None)):
        commit = _git("rev-parse", "HEAD", where=where)
        if commit is not None:
            break
    else:
        return {"available": False}
    status = _git("status", "--porcelain", where=where) or b""
    diff = _git("diff", "HEAD", where=where) or b""
    return {
        "available": True,
        "repository": _text(_git("rev-parse", "--show-toplevel", where=where)).strip(),
        "commit": _text(commit).strip(),
        "branch": _text(_git("rev-parse", "--abbrev-ref", "HEAD", where=where)).strip(),
        "dirty": bool(status.strip()),
        "status": _text(status),
        "diff": _text(diff),
        "diff_truncated": len(diff) > _DIFF_LIMIT,
    }


def _version(name: str) -> str:
    """The version a module reports about itself, as users compare it.

    ``torch.__version__`` keeps its local tag (``2.15.0+cu132``), which the
    distribution's version (``2.15.0``) drops; the distribution's version is
    the fallback for a module that cannot be imported.
    """
    try:
        return str(importlib.import_module(name).__version__)
    except (ImportError, AttributeError):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""


def _packages() -> list[str]:
    found = {
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
    }
    return sorted(found, key=str.lower)


def collect_metadata(world_size: int = 1) -> dict[str, Any]:
    """The run metadata as a nested dict of strings, numbers, bools and string lists."""
    import h5py

    versions = {
        "python": sys.version,
        "platform": platform.platform(),
        "hdf5": h5py.version.hdf5_version,
        **{name: _version(name) for name in ("torch", "numpy", "h5py", "vartrace")},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["cuda"] = torch.version.cuda or ""
    return {
        "command": _command_line(),
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "world_size": world_size,
        "versions": versions,
        "packages": _packages(),
        "git": _git_state(),
        "env": _environment(),
    }
