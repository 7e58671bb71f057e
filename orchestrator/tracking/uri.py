"""The tracking URI: which store a command uses (the configured URI, else $MLFLOW_TRACKING_URI, else
a local SQLite file, made absolute), the SQLite file it names, and the URI as it may be shown: its
password masked, or left out of an address a browser opens. The masking serves every URI of a
config, not only the tracking store's."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

DEFAULT_URI = "sqlite:///mlruns.db"


# `scheme://user:PASSWORD@host`: the password of a URI's userinfo (up to the authority's last @).
_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s/@:]*):[^\s/]*@")
# `?password=SECRET`, `&token=SECRET`: a secret as a query parameter (libpq's and SQLAlchemy's
# password, an API token or key, a presigned URL's signature), by the common names; other parameters
# (sslmode, sslkey=<path>) stay.
_QUERY_SECRET = re.compile(r"([?&](?:[\w.-]*"
                           r"(?:password|passwd|pwd|secret|token|signature|api_?key)[\w.-]*"
                           r"|pass|sig|key)=)[^&#\s'\"]+", re.IGNORECASE)


def mask_password(text: str) -> str:
    """`text` with the password of every URI in it (`postgresql://user:PASSWORD@host/db`, an http
    server's `http://user:PASSWORD@host`, `...?password=PASSWORD`, `...?token=TOKEN`) replaced by
    `***`: what is logged, written or printed of a URI (MLflow params cannot be deleted). Never what
    the product connects with."""
    return _QUERY_SECRET.sub(r"\1***", _PASSWORD.sub(r"\1:***@", text))


def mask_passwords(tree: Any) -> Any:
    """A config's plain data (dicts, lists, values; nested or flat) with `mask_password` applied to
    every string in it: what is written of a config where others read it (study state, tuner.pkl,
    best.yaml)."""
    if isinstance(tree, dict):
        return {key: mask_passwords(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [mask_passwords(value) for value in tree]
    return mask_password(tree) if isinstance(tree, str) else tree


def without_userinfo(url: str) -> str:
    """An http(s) URL without its `user:password@`: the address to open in a browser, which asks for
    the credentials itself."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return (urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
            if "@" in parts.netloc else url)


def resolve_uri(uri: str | None) -> str:
    """The configured URI, else $MLFLOW_TRACKING_URI (set by cluster runtime envs), else a local
    SQLite file. A relative SQLite path becomes absolute, so Ray processes and the printed UI
    command use the same file."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    store = sqlite_file(uri)
    return ("sqlite:///" + os.path.abspath(store)
            if store is not None and not os.path.isabs(store) else uri)


def sqlite_file(uri: str | None) -> str | None:
    """The database file of the SQLite store that `uri` (else $MLFLOW_TRACKING_URI, else the
    default) names, as written (relative or absolute); None for any other store."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
    return uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None


def is_loopback(host: str | None) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback: nothing sent there crosses
    a network."""
    import ipaddress

    if host == "localhost":
        return True
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def credentials_in_clear(uri: str, environ: Mapping[str, str] | None = None) -> str | None:
    """One warning line when the tracking store's credentials (a password in the URI, or MLflow's
    MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN) go unencrypted, over plain http://, to another
    machine; None otherwise."""
    from urllib.parse import urlsplit

    environ = os.environ if environ is None else environ
    parts = urlsplit(uri)
    sent = (parts.password or environ.get("MLFLOW_TRACKING_PASSWORD")
            or environ.get("MLFLOW_TRACKING_TOKEN"))
    if parts.scheme != "http" or not sent or is_loopback(parts.hostname):
        return None
    return (f"warning: the MLflow credentials go unencrypted (http://) to {parts.hostname}: anyone "
            "on the network path can read them; serve MLflow behind https:// and use that URI")
