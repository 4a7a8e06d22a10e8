"""What a run file records about the run that wrote it (``/meta``).

:func:`collect_metadata` gathers the command line, working directory, host,
versions, installed packages, git state, world size, start time and an
allow-listed set of environment variables.  Secrets stay out: environment
variables whose names look secret are never recorded even when allow-listed,
command-line values given to secret-looking options (long or short: ``--pw``,
``-p``) are redacted, and credentials found inside any recorded argument or
variable value (``user:password@`` in URLs, ``password=...`` pairs, tokens of
well-known shapes, private keys, ``password: ...`` lines of a config) are replaced by
``<redacted>``: in the arguments, the variables, the git status and the git diff.  The
diff can be left out alone: ``collect_metadata(git_diff=False)``, or
``H5PYSaverCallback(path, metadata={"git_diff": False})``.

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
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ENV_NAMES",
    "ENV_PREFIXES",
    "collect_metadata",
    "looks_secret",
    "metadata_options",
    "redact",
]

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
_SECRET = re.compile(
    r"TOKEN|KEY|SECRET|PASS(?:WORD|WD|PHRASE)?(?![A-Z])|(?<![A-Z])PWD?(?![A-Z])"
    r"|CREDENTIAL|AUTH|COOKIE|PRIVATE",
    re.I,
)
_SHORT_SECRET_OPTIONS = frozenset({"-p"})  # mysql and friends: -p <password>, -p<password>
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
# Tokens recognisable by their shape alone, wherever they appear.
_TOKEN = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}"
    r"|AKIA[0-9A-Z]{16})\b"
)
# ``name = value`` / ``name: value`` pairs (code, configs, YAML, JSON, shell): the value of a
# secret-looking name, quoted or to the end of the line, is redacted.
_PAIR = re.compile(
    r"""(?P<name>[A-Za-z_][\w.-]*)(?P<sep>["']?[ \t]*[:=][ \t]*)"""
    r"""(?P<value>"[^"\n]*"?|'[^'\n]*'?|[^\s"'][^\n]*)"""
)
# ``--password value`` inside a text (a command in a script or a README).
_OPTION = re.compile(
    r"""(?P<name>(?<![\w-])--?[A-Za-z][\w-]*)(?P<sep>[ \t]+)(?P<value>[^\s-]\S*)"""
)
_BEARER = re.compile(r"\b(Bearer|Basic|Token)[ \t]+[A-Za-z0-9._~+/=-]{8,}", re.I)
_PEM = re.compile(
    r"-----BEGIN (?P<what>[A-Z0-9 ]*PRIVATE KEY[A-Z0-9 ]*)-----.*?(?:-----END (?P=what)-----|\Z)",
    re.S,
)
_REDACTED = "<redacted>"
_DIFF_LIMIT = 1 << 20
_GIT_TIMEOUT_S = 10.0
_OPTIONS = frozenset({"git_diff"})  # keyword options of collect_metadata


def looks_secret(name: str) -> bool:
    """Whether a variable or option name looks like it holds a secret.

    Example: ``looks_secret("HF_TOKEN") and looks_secret("--pw")
    and not looks_secret("OMP_NUM_THREADS")``.
    """
    return name in _SHORT_SECRET_OPTIONS or _SECRET.search(name) is not None


def redact(text: str) -> str:
    """``text`` with the credentials found in it replaced by ``<redacted>``, line by line.

    Credentials in URLs (``https://user:password@host`` -> ``https://<redacted>@host``),
    the value of a ``name=value`` or ``name: value`` pair (code, configs, YAML,
    JSON) or of a ``--name value`` option whose name looks secret, ``Bearer``
    tokens, private-key blocks, and tokens of well-known shapes (GitHub, GitLab,
    Hugging Face, OpenAI, Slack, AWS keys).  Applied to every text of ``/meta``:
    arguments, environment values, git status and diff.
    Example: ``redact("db.password=hunter2") == "db.password=<redacted>"``.
    """
    text = _PEM.sub(_REDACTED, text)
    text = _PAIR.sub(_redact_value, text)
    text = _OPTION.sub(_redact_value, text)
    text = _BEARER.sub(lambda match: f"{match.group(1)} {_REDACTED}", text)
    text = _URL_USERINFO.sub(lambda match: f"{match.group(1)}{_REDACTED}@", text)
    return _TOKEN.sub(_REDACTED, text)


def _redact_value(match: re.Match[str]) -> str:
    """A matched pair with its value redacted when its name looks secret (quotes kept)."""
    name, separator, value = match.group("name", "sep", "value")
    if not looks_secret(name.lstrip("-")):
        return match.group()
    quote = value[0] if value[0] in "\"'" else ""
    return f"{name}{separator}{quote}{_REDACTED}{quote}"


def _environment() -> dict[str, str]:
    return {
        name: redact(value)
        for name, value in sorted(os.environ.items())
        if (name in ENV_NAMES or name.startswith(ENV_PREFIXES)) and not looks_secret(name)
    }


def _command_line() -> list[str]:
    """``sys.argv`` with credentials replaced: the values of secret-looking options
    (``--passphrase x``, ``--pw=x``, ``-p x``, ``-px``) and whatever :func:`redact` finds."""
    redacted: list[str] = []
    hide_next = False
    for argument in sys.argv:
        option, equals, _ = argument.partition("=")
        if hide_next:
            redacted.append(_REDACTED)
            hide_next = False
        elif argument.startswith("-") and looks_secret(option):
            redacted.append(f"{option}={_REDACTED}" if equals else argument)
            hide_next = not equals  # the value follows as the next argument
        elif argument[:2] in _SHORT_SECRET_OPTIONS and argument[2:3] not in ("", "-"):
            redacted.append(f"{argument[:2]}{_REDACTED}")  # -p<password>
        else:
            redacted.append(redact(argument))
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


def _git_state(diff: bool) -> dict[str, Any]:
    """Git state of the running script's repository, else of the working directory's.

    The status and the diff are redacted (:func:`redact`); ``diff=False`` leaves the
    diff out (``diff_left_out``).
    """
    for where in dict.fromkeys((_script_directory(), None)):
        commit = _git("rev-parse", "HEAD", where=where)
        if commit is not None:
            break
    else:
        return {"available": False}
    status = _git("status", "--porcelain", where=where) or b""
    state = {
        "available": True,
        "repository": _text(_git("rev-parse", "--show-toplevel", where=where)).strip(),
        "commit": _text(commit).strip(),
        "branch": _text(_git("rev-parse", "--abbrev-ref", "HEAD", where=where)).strip(),
        "dirty": bool(status.strip()),
        "status": redact(_text(status)),
    }
    if not diff:
        return {**state, "diff_left_out": True}
    patch = _git("diff", "HEAD", where=where) or b""
    return {**state, "diff": redact(_text(patch)), "diff_truncated": len(patch) > _DIFF_LIMIT}


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


def metadata_options(metadata: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """The :func:`collect_metadata` options a saver's ``metadata`` argument asks for.

    ``True``: everything (``{}``); ``False``: no metadata (``None``); a dict of
    options, e.g. ``{"git_diff": False}`` (everything but the uncommitted diff).
    ``TypeError`` names an unknown option.
    """
    if metadata is True or metadata is False:
        return {} if metadata else None
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"metadata must be True, False or a dict of options such as {{'git_diff': False}}, "
            f"not {metadata!r}"
        )
    unknown = sorted(set(metadata) - _OPTIONS)
    if unknown:
        raise TypeError(
            f"unknown metadata option(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(sorted(_OPTIONS))}"
        )
    return dict(metadata)


def collect_metadata(world_size: int = 1, *, git_diff: bool = True) -> dict[str, Any]:
    """The run metadata as a nested dict of strings, numbers, bools and string lists.

    ``git_diff=False`` leaves the uncommitted diff out and keeps everything else.
    """
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
        "git": _git_state(git_diff),
        "env": _environment(),
    }
