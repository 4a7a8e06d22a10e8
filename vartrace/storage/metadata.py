"""What a run file records about the run that wrote it (`/meta`).

`collect_metadata` gathers the command line, working directory, host,
versions, installed packages, git state, world size, start time and an
allow-listed set of environment variables.  Secrets stay out: environment
variables whose names look secret are never recorded even when allow-listed, and
one function, `redact`, replaces the credentials found in every other text by
`<redacted>`, the same way in the command line, the variables' values, the git
status and diff and the packages list: values of secret-looking options (`--pw x`,
`-p x`, `-px`, `curl -u user:pw`, `openssl -k x`), `.netrc` passwords,
`user:password@` in URLs, `password=...` pairs (also after other pairs, as in
connection strings and URL queries), `password: ...` lines of a config, tokens
of well-known shapes and private keys.  The diff can be left out alone:
`collect_metadata(git_diff=False)`, or `H5PYSaverCallback(path, metadata={"git_diff": False})`.

Example:
    ```python
    meta = collect_metadata(world_size=4)
    meta["git"].get("commit"), meta["env"].get("CUDA_VISIBLE_DEVICES")
    ```
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
from collections.abc import Callable, Mapping
from typing import Any

from vartrace._version import __version__

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
    r"|CREDENTIAL|AUTH(?!OR)|COOKIE|PRIVATE",
    re.I,
)
_SHORT_SECRET_OPTIONS = frozenset({"-p"})  # mysql, sshpass and friends: -p <password>, -p<password>
# Single-dash words starting with -p that are common flags, not -p<password>: kept.
_NOT_PASSWORDS = frozenset(
    {"-pedantic", "-perm", "-pg", "-pie", "-pipe", "-pix_fmt", "-port", "-preset", "-print"}
    | {"-print0", "-printf", "-profile", "-prune", "-pthread", "-path"}
)
# Single-dash options naming a password whose value follows (openssl -pass, -passin).
_PASSWORD_OPTIONS = frozenset(
    {"-pass", "-passin", "-passout", "-passwd", "-password", "-pw", "-pwd"}
)
_USER_OPTIONS = frozenset({"-u", "-U", "--user", "--proxy-user"})  # curl: -u user:password
_NETRC_KEYWORDS = frozenset({"machine", "default", "login", "password", "account", "macdef"})
_NETRC_SECRETS = frozenset({"password", "account"})
_URL_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
# Tokens recognisable by their shape alone, wherever they appear.
_TOKEN = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}"
    r"|AKIA[0-9A-Z]{16}|npm_[A-Za-z0-9]{20,}|pypi-AgE[A-Za-z0-9_-]{16,})\b"
)
# ``name = value`` / ``name: value`` pairs (code, configs, YAML, JSON, shell, connection
# strings, URL queries): the value of a secret-looking name, quoted or to the end of the line,
# is redacted; pairs inside another's value are found (see `_redact_pairs`).  ``==`` compares
# (a requirement ``keyring==25.6``, ``token == x``): no pair.
_PAIR = re.compile(
    r"""(?P<name>[A-Za-z_][\w.-]*)(?P<sep>["']?[ \t]*(?::|=(?!=))[ \t]*)"""
    r"""(?P<value>"[^"\n]*"?|'[^'\n]*'?|[^\s"'][^\n]*)"""
)
# A word of a line: unquoted runs and quoted strings (spaces inside) joined.
_WORD = re.compile(r"""(?:"[^"\n]*"|'[^'\n]*'|[^\s"']+|["'])+""")
# A word's brackets, quotes and commas around it (``["sshpass", "-p", "pw"]``) and its core.
_BARE = re.compile(r"""([\[("']*)(.*?)([\])"',;]*)""", re.S)
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
    """`text` with the credentials found in it replaced by `<redacted>`, line by line.

    The one redaction of `/meta`: applied to the command line (its
    arguments as the words of a line), environment values, git status and diff
    and the packages list.  It replaces private-key blocks; in each line the value of
    an option whose name looks secret (`--password x`, `--pw=x`,
    `-pass x`), of `-p` (`-p x`, `-px`: mysql, sshpass, and so also
    `ssh -p 22`; not after `mkdir`, nor common flags such as `-pthread`),
    the password of `-u user:password` (curl), of `-k x` after `openssl`
    and of `password x` in a `.netrc` line, also inside a quoted list
    (`["sshpass", "-p", "x"]`); the value of a `name=value` or
    `name: value` pair whose name looks secret (code, configs, YAML, JSON), also after
    other pairs (`Server=x;Password=y`, `?user=bob&password=y`, `user=bob,token=y`),
    `Bearer` tokens, credentials in URLs (`https://user:password@host` ->
    `https://<redacted>@host`) and tokens of well-known shapes (GitHub,
    GitLab, Hugging Face, OpenAI, Slack, AWS, npm, PyPI).
    Example: `redact("mysql -u root -phunter2") == "mysql -u root -p<redacted>"`.
    """
    text = _PEM.sub(_REDACTED, text)
    return "".join(_redact_line(line) for line in text.splitlines(keepends=True))


def _command_line() -> list[str]:
    """`sys.argv` with credentials replaced as `redact` replaces them in a line of
    text: `mysql -p x` -> `["mysql", "-p", "<redacted>"]`."""
    return [redact(word) for word in _redact_words(sys.argv)]


def _redact_line(line: str) -> str:
    """One line of text with its credentials redacted (private keys aside)."""
    if "-" in line or any(keyword in line for keyword in _NETRC_SECRETS):  # else no option
        spans = [match.span() for match in _WORD.finditer(line)]
        words = _redact_words([line[start:stop] for start, stop in spans])
        pieces, end = [], 0
        for (start, stop), word in zip(spans, words, strict=True):
            pieces += [line[end:start], word]
            end = stop
        line = "".join([*pieces, line[end:]])
    line = _redact_pairs(line)
    line = _BEARER.sub(lambda match: f"{match.group(1)} {_REDACTED}", line)
    line = _URL_USERINFO.sub(lambda match: f"{match.group(1)}{_REDACTED}@", line)
    return _TOKEN.sub(_REDACTED, line)


def _redact_words(words: list[str]) -> list[str]:
    """Words of a command with the values of secret-looking options redacted.

    A word is judged by its core, without the quotes, brackets and commas
    around it (`"-p",` is `-p`), which stay.
    """
    parts = [_bare(word) for word in words]
    # A .netrc line starts with one of its keywords (after the + or - of a diff line).
    first = next((core.lstrip("+-") for _, core, _ in parts if core.lstrip("+-")), "")
    netrc = first in _NETRC_KEYWORDS
    redacted: list[str] = []
    hide: Callable[[str], str] | None = None  # how the value expected next is redacted
    previous = ""
    openssl = False
    for prefix, core, suffix in parts:
        if hide is not None and core and not core.startswith("-"):
            new, hide = hide(core), None
        else:
            new, hide = _option(core, previous, netrc=netrc, openssl=openssl)
        command = os.path.basename(core.lstrip("+-"))
        openssl = openssl or command == "openssl"
        previous = command
        redacted.append(f"{prefix}{new}{suffix}")
    return redacted


def _option(
    core: str, previous: str, *, netrc: bool, openssl: bool
) -> tuple[str, Callable[[str], str] | None]:
    """A word with its own secret redacted, and how the next word is, if it is the value."""
    if netrc and core in _NETRC_SECRETS:
        return core, _hidden
    if not core.startswith("-"):
        return core, None
    option, equals, value = core.partition("=")
    if option in _USER_OPTIONS:
        return (f"{option}={_password_of(value)}", None) if equals else (core, _password_of)
    if core[:2] in ("-u", "-U") and ":" in core:
        return f"{core[:2]}{_password_of(core[2:])}", None  # -uuser:password
    if (
        core[:2] == "-p"
        and core[2:3] not in ("", "-", "=")
        and option not in _PASSWORD_OPTIONS
        and core not in _NOT_PASSWORDS
    ):
        return f"-p{_hidden(core[2:])}", None  # -p<password>
    secret = looks_secret(option) or option in _PASSWORD_OPTIONS
    if secret and not (option == "-p" and previous == "mkdir"):
        return (f"{option}={_hidden(value)}", None) if equals else (core, _hidden)
    if core == "-k" and openssl:
        return core, _hidden
    return core, None


def _bare(word: str) -> tuple[str, str, str]:
    """A word as the quotes and brackets before its core, its core, and those after."""
    match = _BARE.fullmatch(word)
    assert match is not None  # every part of the pattern may be empty
    prefix, core, suffix = match.groups()
    return prefix, core, suffix


def _hidden(value: str) -> str:
    """`<redacted>` for `value`, its opening quote kept (the closing one is kept too)."""
    return f"{value[0]}{_REDACTED}" if value[:1] in ("'", '"') else _REDACTED


def _password_of(value: str) -> str:
    """`user:password` with the password redacted; a bare user name is kept."""
    user, colon, _ = value.partition(":")
    return f"{user}:{_REDACTED}" if colon else value


def _redact_pairs(line: str) -> str:
    """`line` with the value of each pair whose name looks secret redacted (quotes kept;
    unquoted, to the end of the line).  The value of any other pair is searched for pairs
    too: in `Protocol=https;AccountKey=x`, `db?user=bob&password=x` or `user=bob,token=x`
    the first pair's value holds the secret one."""
    pieces: list[str] = []
    kept = search = 0  # line[:kept] is in pieces; the next pair starts at search or later
    while (match := _PAIR.search(line, search)) is not None:
        if not looks_secret(match.group("name").lstrip("-")):
            search = match.start("value")
            continue
        value = match.group("value")
        quote = value[0] if value[0] in "\"'" else ""
        pieces += [line[kept : match.start("value")], f"{quote}{_REDACTED}{quote}"]
        kept = search = match.end()
    return "".join([*pieces, line[kept:]])


def _environment() -> dict[str, str]:
    return {
        name: redact(value)
        for name, value in sorted(os.environ.items())
        if (name in ENV_NAMES or name.startswith(ENV_PREFIXES)) and not looks_secret(name)
    }


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
    """The directory of the running script (`python path/train.py`), if there is one."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.dirname(os.path.abspath(script)) if script else None


def _git_state(diff: bool) -> dict[str, Any]:
    """Git state of the running script's repository, else of the working directory's.

    The status and the diff are redacted (`redact`); `diff=False` leaves the
    diff out (`diff_left_out`).
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

    `torch.__version__` keeps its local tag (`2.15.0+cu132`), which the
    distribution's version (`2.15.0`) drops; the distribution's version is
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
    """The installed distributions as `name==version`, redacted as the rest of `/meta`."""
    found = {
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"]
    }
    return [redact(package) for package in sorted(found, key=str.lower)]


def metadata_options(metadata: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """The `collect_metadata` options a saver's `metadata` argument asks for.

    `True`: everything (`{}`); `False`: no metadata (`None`); a dict of
    options, e.g. `{"git_diff": False}` (everything but the uncommitted diff).
    `TypeError` names an unknown option.
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

    `git_diff=False` leaves the uncommitted diff out and keeps everything else.
    """
    import h5py

    versions = {
        "python": sys.version,
        "platform": platform.platform(),
        "hdf5": h5py.version.hdf5_version,
        **{name: _version(name) for name in ("torch", "numpy", "h5py")},
        "vartrace": __version__,
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
