"""The epoch server's shared token: a file only its owner can read (like an SSH key).

``ipcount serve`` makes one if the file is missing; every client (the DAGs' operator, the
benchmark, chaos) reads the same file and sends it as ``Authorization: Bearer <token>``.
"""
from __future__ import annotations

import hmac
import secrets
from pathlib import Path

from ipcount.rules.errors import EpochServerError
from ipcount.rules.private_files import open_to_others, write_private_file

MIN_TOKEN_CHARS = 16


def ensure_token(path: Path) -> str:
    """The token in ``path``, made (random, mode 0600) if the file does not exist."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_private_file(path, secrets.token_urlsafe(32) + "\n", exclusive=True)
    except FileExistsError:
        pass
    return read_token(path)


def read_token(path: Path) -> str:
    """The token in ``path``; refused if the file is missing, empty, or others may read it."""
    try:
        mode = open_to_others(path)
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise EpochServerError(f"no epoch server token at {path}: `ipcount serve` makes it on start; a client on "
                               "another machine needs a copy (mode 0600), named by epoch_server_token_file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EpochServerError(f"the epoch server token file {path} cannot be read: {e}") from None
    if mode is not None:
        raise EpochServerError(f"the epoch server token file {path} is open to others (mode {mode:o}); "
                               f"make it private: chmod 600 {path}")
    if len(text) < MIN_TOKEN_CHARS or any(c.isspace() for c in text):
        raise EpochServerError(f"the epoch server token file {path} must hold one token of at least "
                               f"{MIN_TOKEN_CHARS} characters, without spaces")
    return text


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``token`` (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme == "Bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
