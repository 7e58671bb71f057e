"""The tracking URI: which store a command uses (the configured URI, else $MLFLOW_TRACKING_URI, else a local SQLite
file, made absolute), the SQLite file it names, and the URI as it may be shown: its password masked, or left out of
an address a browser opens."""

from __future__ import annotations

import os
import re

DEFAULT_URI = "sqlite:///mlruns.db"


# `scheme://user:PASSWORD@host`: the password of a URI's userinfo (up to the authority's last @).
_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*):[^\s/]*@")


def mask_password(text: str) -> str:
    """`text` with the password of every URI in it (`postgresql://user:PASSWORD@host/db`, an http server's
    `http://user:PASSWORD@host`) replaced by `***`: what is logged, written or printed of a tracking URI (MLflow
    params cannot be deleted). Never what the product connects with."""
    return _PASSWORD.sub(r"\1:***@", text)


def without_userinfo(url: str) -> str:
    """An http(s) URL without its `user:password@`: the address to open in a browser, which asks for the
    credentials itself."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])) if "@" in parts.netloc else url


def resolve_uri(uri: str | None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI (set by cluster runtime envs), else a local SQLite file.
    A relative SQLite path becomes absolute, so Ray processes and the printed UI command use the same file."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    store = sqlite_file(uri)
    return "sqlite:///" + os.path.abspath(store) if store is not None and not os.path.isabs(store) else uri


def sqlite_file(uri: str | None) -> str | None:
    """The database file of the SQLite store that `uri` (else $MLFLOW_TRACKING_URI, else the default) names, as
    written (relative or absolute); None for any other store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    return uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
