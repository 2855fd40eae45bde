"""Building a native library of several C files at first use, the way `cpu_fp4_build` builds cpu_fp4.c.

`build_native(stem, sources, headers, config)` compiles the sources into one shared library
`<stem>-<hash>.so` in the same cache directory as cpu_fp4 (compiler discovery, `BuildConfig` flags,
cache fallback and the hash over sources, headers, flags, compiler and host CPU are cpu_fp4_build's),
written to a temporary name and renamed into place, so concurrent processes never load a half-written
library. Used by the CPU mailbox (cpu_mailbox.c linked with cpu_fp4.c).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import structlog

from common.kernels.cpu_fp4_build import (BuildConfig, NativeBuildError, _compiler_id, _host_cpu_id,
                                          default_cache_dir)

log = structlog.get_logger("native_build")


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
    log.info("native_build.built", path=str(target), flags=" ".join(config.flags()))
    return target
