"""Secrets in a config: named by an environment variable, never written in it, never repeated in a message.

A config error reaches the terminal and, in a deployed run, Prefect's logs and database; so whatever part of the
input an error quotes goes through `redact` first: values under a secret-looking key are hidden, and the user:password
of a URL is dropped.
"""

from __future__ import annotations

import re
from typing import Any

# Keys whose value is a secret. `token_env` and friends name a variable, they are not one.
SECRET_KEY = re.compile(r"token|secret|passw|api_?key|credential|auth", re.IGNORECASE)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# `${VAR}` or `$VAR`: a reference to an environment variable, the one way a config may name a token.
ENV_REF = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
HIDDEN = "<hidden>"


def is_secret_key(key: object) -> bool:
    return isinstance(key, str) and bool(SECRET_KEY.search(key)) and not key.lower().endswith("_env")


def redact(value: Any) -> Any:
    """`value` as an error message may show it: secret-keyed values hidden, URL credentials dropped."""
    if isinstance(value, dict):
        return {k: HIDDEN if is_secret_key(k) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return _USERINFO.sub(lambda m: m["scheme"] + HIDDEN + "@", value)
    return value


def env_reference(value: Any) -> str | None:
    """The variable a `${VAR}` / `$VAR` value names, else None."""
    m = ENV_REF.fullmatch(value.strip()) if isinstance(value, str) else None
    return None if m is None else m["braced"] or m["bare"]
