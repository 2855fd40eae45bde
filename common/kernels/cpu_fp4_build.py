"""Building native CPU kernels at first use: compiler discovery, cache directory, atomic install.

`build_native(stem, sources, headers, config)` builds any set of C files into one library;
`build_library` is cpu_fp4.c alone, the CPU mailbox links cpu_mailbox.c with it.

The library is compiled once per (sources, flags, compiler, host CPU) into `$MOEMESH_CACHE_DIR/kernels/`
(default `~/.cache/moemesh/kernels/`; `$TMPDIR/moemesh-kernels-<uid>` if that is not writable) as
`cpu_fp4-<hash>.so`, written to a temporary name and renamed into place, so concurrent workers never
load a half-written library. The hash covers the host CPU because `-march=native` code built on one
machine may not run on another that shares the cache directory. No I/O at import.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("cpu_fp4")

SOURCE_PATH = Path(__file__).with_name("cpu_fp4.c")
HEADER_PATHS = tuple(Path(__file__).with_name(n) for n in ("cpu_fp4_tile.h", "cpu_fp4_pool.h"))  # in the hash
BASE_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
OPENMP_FLAG = "-fopenmp"
CACHE_ENV = "MOEMESH_CACHE_DIR"
CC_ENV = "CC"


class NativeBuildError(RuntimeError):
    """The kernel could not be built or loaded; the message says why (compiler output included)."""


@dataclass(frozen=True)
class BuildConfig:
    """How the library is built. `extra_flags` are appended (tests use `-mno-avx512f` etc. to build the
    AVX2 and scalar variants on an AVX-512 host); `openmp` False builds without -fopenmp (the pool
    executor needs only pthreads)."""

    compiler: str
    extra_flags: tuple[str, ...] = ()
    cache_dir: Path | None = None
    openmp: bool = True

    def flags(self) -> tuple[str, ...]:
        return BASE_FLAGS + ((OPENMP_FLAG,) if self.openmp else ()) + self.extra_flags


def find_compiler() -> str | None:
    """$CC, else the first of cc / gcc / clang on PATH."""
    if os.environ.get(CC_ENV):
        return os.environ[CC_ENV]
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "moemesh") / "kernels"


def _host_cpu_id() -> str:
    """Model name and ISA flags of this host's CPU (what -march=native depends on)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "vendor_id"))]
    return "\n".join(dict.fromkeys(keep))  # one copy of each distinct line


def _compiler_id(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"compiler {compiler!r} does not run: {error}") from error


def build_library(config: BuildConfig) -> Path:
    """Compile cpu_fp4.c (once; later calls find the cached file) and return the library's path."""
    return build_native("cpu_fp4", (SOURCE_PATH,), HEADER_PATHS, config)


def _cache_dir_for(name: str, config: BuildConfig) -> Path:
    """The first cache directory that holds `name` or can be written (as cpu_fp4_build picks it)."""
    candidates = [config.cache_dir] if config.cache_dir else [
        default_cache_dir(), Path(tempfile.gettempdir()) / f"moemesh-kernels-{os.getuid()}"]
    for cache_dir in candidates:
        if (cache_dir / name).exists():
            return cache_dir
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(cache_dir, os.W_OK):
            return cache_dir
    raise NativeBuildError(f"no writable cache directory among {[str(c) for c in candidates]}")


def build_native(stem: str, sources: Sequence[Path], headers: Sequence[Path], config: BuildConfig) -> Path:
    """Compile `sources` (with `headers` in the hash) into `<stem>-<hash>.so` once; return its path.
    Raises NativeBuildError with the compiler's output."""
    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in (*sources, *headers)), " ".join(config.flags()).encode(),
                 _compiler_id(config.compiler).encode(), _host_cpu_id().encode()):
        digest.update(part)
        digest.update(b"\0")
    name = f"{stem}-{digest.hexdigest()[:20]}.so"
    cache_dir = _cache_dir_for(name, config)
    target = cache_dir / name
    if target.exists():
        return target
    handle, temp_name = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=cache_dir)
    os.close(handle)
    command = [config.compiler, *config.flags(), "-o", temp_name, *map(str, sources), "-lm", "-lpthread"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise NativeBuildError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
        os.replace(temp_name, target)  # atomic: another process either sees no file or the whole one
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"{' '.join(command)}: {error}") from error
    finally:
        if os.path.exists(temp_name):
            os.unlink(temp_name)
    log.info("native.built", path=str(target), flags=" ".join(config.flags()))
    return target
