"""API tokens: random secrets shown once, stored as sha256 hashes (a token is high-entropy, so a fast hash is enough)."""

from __future__ import annotations

import hashlib
import secrets

TOKEN_PREFIX = "tlt_"


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
