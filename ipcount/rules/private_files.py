"""Files that hold secrets (passwords, keys, tokens): made private from their first byte, read only when nobody else may
read them, as ssh treats its keys."""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ipcount.rules.errors import ConfigError


def open_to_others(path: str | Path) -> int | None:
    """The file's mode if its group or others may use it, else None."""
    mode = stat.S_IMODE(Path(path).stat().st_mode)
    return mode if mode & (stat.S_IRWXG | stat.S_IRWXO) else None


def write_private_file(path: str | Path, data: str | bytes, exclusive: bool = False) -> Path:
    """Write ``data`` to ``path`` created with mode 0600 (never readable by others, not even for a moment);
    ``exclusive``: FileExistsError if it exists."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # a file that was there keeps its mode otherwise
    with os.fdopen(fd, "wb") as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def read_private_file(path: str | Path, setting: str) -> str:
    """The text of a secret file named by ``setting``, without one line end; refused (naming the setting) if it is
    missing, empty, or others may read it."""
    p = Path(path)
    try:
        mode = open_to_others(p)
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{setting}: no file {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{setting}: {p} cannot be read: {e}") from None
    if mode is not None:
        raise ConfigError(f"{setting}: {p} is open to others (mode {mode:o}); make it private: chmod 600 {p}")
    secret = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not secret:
        raise ConfigError(f"{setting}: {p} is empty")
    return secret
