"""Whether a model or tokenizer id, or a dataset's name, can come from the Hugging Face Hub, asked before
transformers or datasets is.

On a machine without network, ``from_pretrained("org/model")`` spends about 50 s in huggingface_hub's retries
before it fails (``datasets.load_dataset_builder("name")`` about 25 s, printing each retry).
:func:`hub_unreachable` answers in a few seconds: an id that is neither a local directory nor in the local cache
needs the Hub, and one TCP connection to its endpoint says whether it can be reached (not asked where a proxy
carries the requests: then the hub client decides). The name lookup is bounded too: a broken
resolver can block ``socket.getaddrinfo``, which takes no timeout, for minutes. A run asks through one
:class:`HubProbe`, so the endpoint is probed once however many names it loads (the model, the tokenizer, their
config, the dataset).
"""

from __future__ import annotations

import errno
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["HubProbe", "hub_unreachable"]

PROBE_TIMEOUT_S = 5.0
CACHED_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def _cached(name: str, repo_type: str) -> bool:
    from huggingface_hub import constants, try_to_load_from_cache

    if repo_type == "dataset":  # the hub's copy of its files, or what datasets built from them (its own cache)
        import datasets.config
        from datasets.naming import camelcase_to_snakecase

        hub_copy = Path(constants.HF_HUB_CACHE) / ("datasets--" + name.replace("/", "--"))
        *namespace, dataset = name.split("/")  # where datasets looks for a build without the Hub (its cache factory)
        built = Path(datasets.config.HF_DATASETS_CACHE) / "___".join([*namespace, camelcase_to_snakecase(dataset)])
        return hub_copy.is_dir() or built.is_dir()
    return any(isinstance(try_to_load_from_cache(name, filename), str) for filename in CACHED_FILES)


def _through_proxy(scheme: str, host: str) -> bool:
    """Whether the environment sends requests to ``host`` through a proxy (HTTPS_PROXY, ALL_PROXY, ... unless
    NO_PROXY lists it), where a direct connection says nothing."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get(scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(host)


def hub_unreachable(name: str, timeout_s: float = PROBE_TIMEOUT_S, *, repo_type: str = "model") -> str | None:
    """Why ``name`` cannot be loaded from the Hub (None where it can, or where transformers or datasets should
    decide): it is not a local path, not cached, and the Hub's endpoint (``HF_ENDPOINT``) refuses a connection.
    ``repo_type``: "model" (a model or tokenizer id) or "dataset" (a hub dataset's name, whose files datasets
    caches in the hub's cache and builds in its own). A run asks through one :class:`HubProbe` instead."""
    return HubProbe(timeout_s).unreachable(name, repo_type=repo_type)


class HubProbe:
    """:func:`hub_unreachable`'s answers for one run, the Hub's endpoint connected to once (a probe of a Hub that
    cannot be reached costs up to its timeout, whichever names it is asked about). Made by whoever resolves the run
    and handed to each check that names a hub id (the model, the tokenizer, its config, the dataset)."""

    def __init__(self, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._connections: dict[tuple[str, int], OSError | None] = {}  # (host, port) -> why it failed, or None

    def unreachable(self, name: str, *, repo_type: str = "model") -> str | None:
        """:func:`hub_unreachable` of ``name``; the endpoint is probed on the first name that needs it, and its
        answer is remembered for every later name."""
        from huggingface_hub import constants

        if Path(name).expanduser().exists() or constants.HF_HUB_OFFLINE:  # offline: transformers fails at once
            return None
        try:
            if _cached(name, repo_type):
                return None
        except Exception:  # noqa: BLE001 (an id the hub's validators reject: transformers names the problem)
            return None
        endpoint = urlsplit(constants.ENDPOINT)
        host, port = endpoint.hostname, endpoint.port or (80 if endpoint.scheme == "http" else 443)
        if host is None or _through_proxy(endpoint.scheme, host):  # a proxy's route is the hub client's to try
            return None
        error = self._connection_error(host, port)
        if error is None:
            return None
        return (
            f"{name!r} is not a local directory nor in the Hugging Face cache, and the Hub ({constants.ENDPOINT}) "
            f"cannot be reached ({error.strerror or type(error).__name__})"
        )

    def _connection_error(self, host: str, port: int) -> OSError | None:
        """Why ``host:port`` refused a connection (None: it took one), asked on the first call and remembered."""
        if (host, port) not in self._connections:
            try:
                _connect(host, port, self.timeout_s)
                self._connections[host, port] = None
            except OSError as error:
                self._connections[host, port] = error
        return self._connections[host, port]


def _lookup(host: str, port: int, timeout_s: float) -> list[tuple]:
    """``socket.getaddrinfo(host, port)`` for TCP, or TimeoutError after ``timeout_s``: it runs in a daemon thread,
    left to finish on its own (getaddrinfo cannot be interrupted)."""
    found: list = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as error:
            found.append(error)

    thread = threading.Thread(target=lookup, name=f"hub lookup {host}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not found:
        raise TimeoutError(errno.ETIMEDOUT, f"the name lookup of {host} took more than {timeout_s:g} s")
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0]


def _connect(host: str, port: int, timeout_s: float) -> None:
    """One TCP connection to ``host:port`` (as ``socket.create_connection``: each address in turn), the name lookup
    and each connection attempt bounded by ``timeout_s``; OSError when none connects."""
    error: OSError = OSError(errno.EHOSTUNREACH, f"no address for {host}")
    for family, kind, proto, _, address in _lookup(host, port, timeout_s):
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.settimeout(timeout_s)
                sock.connect(address)
                return
        except OSError as failed:
            error = failed
    raise error
