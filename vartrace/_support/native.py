"""Small C extension modules of the package, built on the machine that runs them.

A few hot spots are a C function each (the statistics kernel, `summary.c`; the byte
comparison of change detection, `bytes.c`): a call costs what a Python function's does,
where ctypes' argument conversion costs ten times that.  `load(source, name)` builds the
C file `source`, an extension module named `name`, with the C compiler Python was built
with (`$CC` first), into `$XDG_CACHE_HOME/vartrace` (`~/.cache/vartrace`) once per
machine, source and compiler, and imports it; later processes load the cached file.
A tracer builds what it will call when it starts, so that no step compiles.  Where a
module cannot be built (no compiler, no `Python.h`, no writable cache), `load` returns
`None` and the caller takes its pure-Python or ctypes path.

Example:
    ```python
    module = load(Path(__file__).with_name("bytes.c"), "vartrace_bytes")
    module.memcmp(a.data_ptr(), b.data_ptr(), a.nbytes) if module else None
    ```
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType

__all__ = ["load"]

_FLAGS = ("-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
#: Symbols of Python's own are found when the module is loaded (macOS links none by default).
_LINK = ("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()
_COMPILE_SECONDS = 120

_loaded: dict[str, ModuleType | None] = {}  # name -> the module, or None: not buildable
_building = threading.Lock()


def load(source: Path, name: str) -> ModuleType | None:
    """The extension module `name` built from the C file `source` (its `PyInit_<name>`),
    built into the cache first where no build of this source is there; `None` where it
    cannot be built here.  Loaded once per process."""
    if name in _loaded:
        return _loaded[name]
    with _building:
        if name not in _loaded:
            try:
                path = _built(source, name)
                spec = importlib.util.spec_from_file_location(name, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                _loaded[name] = module
            except (OSError, ImportError, subprocess.SubprocessError):
                _loaded[name] = None
    return _loaded[name]


def _compiler() -> list[str]:
    """The C compiler's command: `$CC`, else the one Python was built with, else `cc`."""
    command = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    if not command or shutil.which(command[0]) is None:
        raise OSError("no C compiler")
    return command


def _built(source: Path, name: str) -> Path:
    """The shared library of `source`, compiled into the cache on first use: named by a
    digest of the source, the compiler and its flags; written under a temporary name and
    renamed, so that processes building it at once each load a whole file."""
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError("no Python.h")  # (a Python without its development headers)
    command = [*_compiler(), *_FLAGS, f"-I{include}", *_LINK]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *map(str.encode, command)]))
    folder = _cache()
    library = folder / f"{name}-{key.hexdigest()[:16]}{suffix}"
    if library.exists():
        return library
    handle, temporary = tempfile.mkstemp(suffix=suffix, dir=folder)
    os.close(handle)
    try:
        subprocess.run(
            [*command, "-o", temporary, str(source)],
            check=True,
            capture_output=True,
            timeout=_COMPILE_SECONDS,
        )
        os.replace(temporary, library)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return library


def _cache() -> Path:
    """`$XDG_CACHE_HOME/vartrace` (`~/.cache/vartrace`), made if missing."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(root) / "vartrace"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
