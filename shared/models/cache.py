"""Where built models live, and how one is built: once, atomically.

A cache entry is a directory under :func:`cache_root` holding ``tandem-cache-version``
(:data:`CACHE_VERSION`); one without it, with another version, or with a link whose target has gone,
is rebuilt. A build writes into a
temporary sibling and renames it, so a killed build leaves no half entry.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Bump when the converted layout changes so stale caches are rebuilt.
CACHE_VERSION = "2"


def cache_root() -> Path:
    """Where converted models live: $TANDEM_CACHE/models, else $XDG_CACHE_HOME/tandem/models, else
    ~/.cache/tandem/models (an empty or relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"]).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "tandem" / "models"


def progress(msg: str, done: int, total: int, t0: float) -> None:
    """One-line progress bar on stderr (conversion is the only long step)."""
    width = 30
    filled = int(width * done / max(total, 1))
    bar = "#" * filled + "-" * (width - filled)
    end = "\n" if done >= total else "\r"
    sys.stderr.write(f"{msg} [{bar}] {done}/{total} {time.time() - t0:5.1f}s{end}")
    sys.stderr.flush()


def is_cached(name: str) -> bool:
    """Whether entry ``name`` is built, by this version, and whole: a link whose target has gone (the
    embedded model's GGUF lives in the package of the venv that built the entry, and a venv gets
    reinstalled) makes it stale, so it is rebuilt."""
    entry = cache_root() / name
    stamp = entry / "tandem-cache-version"
    if not stamp.exists() or stamp.read_text().strip() != CACHE_VERSION:
        return False
    return all(p.exists() for p in entry.iterdir() if p.is_symlink())


def build_atomically(target: Path, builder, quiet: bool) -> None:
    """Build into a temporary sibling, then rename: a killed conversion leaves no half cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        builder(tmp, quiet)
        (tmp / "tandem-cache-version").write_text(CACHE_VERSION)
        if target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its result is equivalent.
            if not is_cached(target.name):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
