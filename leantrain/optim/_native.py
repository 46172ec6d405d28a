"""Builds and loads the C kernels in ``_kernels/`` (plain C99 + OpenMP, no torch).

Every source in :data:`SOURCES` goes into one shared library (the Gefen step, the
codebook dynamic program, the finite check and the factor means), compiled on first
use with the system C compiler into a cache directory (``$LEANTRAIN_CACHE``, else
``~/.cache/leantrain``), under a name keyed by a hash of the sources, the compiler's
version, the flags and the CPU's feature flags, so an edit, a new compiler or
another machine type never loads a stale binary. The build writes a temporary file
and renames it into place, so parallel processes (pytest-xdist, torchrun ranks)
never see a half-written file.

Nothing here raises when no compiler exists or a build fails: :func:`load` returns
None and :func:`status` says why, and callers fall back to PyTorch.
``LEANTRAIN_NO_NATIVE=1`` disables the native path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "_kernels"
# One library from all sources: one build, one load, one cache entry.
SOURCES = ("gefen_step.c", "codebook_dp.c", "finite.c", "factor_sums.c")
# Included by gefen_step.c: part of the cache key, never compiled on their own.
HEADERS = (
    "gefen_codes.h",
    "gefen_io.h",
    "gefen_avx512.h",
    "gefen_job.h",
    "gefen_sr.h",
    "gefen_factored.h",
    "gefen_prepass.h",
)
LIBRARY = "leantrain_kernels"
# -ffp-contract=off: the kernel writes every fused multiply-add it wants (to round
# like torch's vectorized ops) and the compiler must not add others.
# -fno-math-errno lets sqrtf inline; it changes no result.
FLAGS = (
    "-O3",
    "-march=native",
    "-std=c99",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-shared",
    "-fPIC",
)
OPENMP = ("-fopenmp",)

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False
_status = "not built yet"


def cache_dir() -> Path:
    """The directory holding built libraries (created on demand)."""
    root = os.environ.get("LEANTRAIN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "leantrain"


def disabled() -> bool:
    """True when ``LEANTRAIN_NO_NATIVE`` asks for the PyTorch fallback."""
    return os.environ.get("LEANTRAIN_NO_NATIVE", "0") not in ("", "0")


def compiler() -> str | None:
    """Path of the C compiler (``$CC``, else gcc, else cc), or None."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    # -march=native code is only valid on CPUs with the same features.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() + platform.machine()


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        )
        return out.stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def library_path(cc: str, flags: tuple[str, ...]) -> Path:
    """Where the library for these sources, compiler, flags and CPU lives."""
    digest = hashlib.sha256()
    for part in (
        *((KERNEL_DIR / name).read_bytes() for name in SOURCES + HEADERS),
        _compiler_version(cc).encode(),
        " ".join(flags).encode(),
        _cpu_flags().encode(),
        platform.machine().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return cache_dir() / f"{LIBRARY}-{digest.hexdigest()[:20]}.so"


def build(cc: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Compiles the sources to ``target`` atomically; returns an error text or None."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=target.parent)
        os.close(fd)
    except OSError as err:  # e.g. a read-only home directory
        return f"cannot write to the cache {target.parent}: {err}"
    try:
        cmd = [cc, *flags, *(str(KERNEL_DIR / name) for name in SOURCES), "-o", tmp]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as err:
            return f"{' '.join(cmd)}: {err}"
        if out.returncode != 0:
            return f"{' '.join(cmd)} failed:\n{out.stderr.strip()}"
        os.replace(tmp, target)  # atomic: readers see no file or a whole one
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.lt_gefen_step_many.restype = ctypes.c_int
    lib.lt_gefen_step_many.argtypes = [pointer, i32, i64, i32, i32]
    lib.lt_codebook_dp.restype = ctypes.c_double
    lib.lt_codebook_dp.argtypes = [pointer] * 5 + [i64, i64, pointer, pointer]
    lib.lt_all_finite.restype = ctypes.c_int
    lib.lt_all_finite.argtypes = [pointer, i64, i32, ctypes.c_uint32, i32]
    lib.lt_factor_means.restype = ctypes.c_int
    lib.lt_factor_means.argtypes = [pointer, i32, i64, i64, i64] + [pointer] * 3 + [i32]
    for name in (
        "lt_sizeof_quantizer",
        "lt_sizeof_hyper",
        "lt_sizeof_io",
        "lt_sizeof_job",
        "lt_sizeof_opts",
        "lt_max_chunk",
    ):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []


def _compile_and_load() -> tuple[ctypes.CDLL | None, str]:
    cc = compiler()
    if cc is None:
        return None, "no C compiler found ($CC, gcc, cc)"
    errors = []
    # Without OpenMP (e.g. clang lacking libomp) the kernel still builds, 1 thread.
    for flags in (FLAGS + OPENMP, FLAGS):
        target = library_path(cc, flags)
        if not target.exists():
            error = build(cc, flags, target)
            if error is not None:
                errors.append(error)
                continue
        try:
            lib = ctypes.CDLL(str(target))
        except OSError as err:
            errors.append(f"loading {target}: {err}")
            continue
        _declare(lib)
        note = "" if flags[-1] == OPENMP[-1] else " (built without OpenMP: 1 thread)"
        return lib, f"loaded {target}{note}"
    return None, "; ".join(errors)


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first call; None if disabled or unavailable."""
    global _library, _tried, _status
    if disabled():
        return None
    with _lock:
        if not _tried:
            _library, _status = _compile_and_load()
            _tried = True
    return _library


def status() -> str:
    """Why the native library is (not) in use: the path loaded or the error."""
    if disabled():
        return "disabled by LEANTRAIN_NO_NATIVE"
    return _status
