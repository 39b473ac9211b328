"""Fail fast when the Hugging Face hub cannot be reached.

`from_pretrained` / `load_dataset` on a machine without network retry for minutes before they
give up with a stack of connection errors. Before touching the hub we therefore (1) honour
``HF_HUB_OFFLINE``, (2) otherwise open one TCP connection to the hub endpoint (or the configured
proxy) with a 3 s deadline. If the hub is unreachable but the files are in the local HF cache,
loading goes on from the cache; if not, one line says so and names the local alternatives.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

from zfctl.errors import ConfigError

PROBE_TIMEOUT_S = 3.0
_probe_result: dict[str, bool] = {}  # endpoint -> reachable; probed once per process


def hub_endpoint() -> str:
    """The hub URL huggingface_hub will use (``HF_ENDPOINT`` or huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_offline_requested() -> bool:
    """True when the user set ``HF_HUB_OFFLINE=1`` (huggingface_hub reads it at import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub (or the HTTPS proxy in front of it) opens in time.

    The connect runs in a daemon thread joined with a deadline, because a hanging DNS lookup is
    not covered by the socket timeout. The answer is cached for the process: the model and the
    data loader both ask, and the network does not come and go within one start-up.
    """
    endpoint = hub_endpoint()
    if endpoint in _probe_result:
        return _probe_result[endpoint]
    url = urlparse(os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") or endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="zfctl-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    _probe_result[endpoint] = bool(result and result[0])
    return _probe_result[endpoint]


def is_cached(repo_id: str, filename: str, repo_type: str = "model") -> bool:
    """Whether `filename` of `repo_id` is in the local HF cache (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, repo_type=repo_type), str)
    except ValueError:  # not a valid repo id at all
        return False


def require_hub(repo_id: str, probe_file: str, *, key: str, alternatives: str,
                repo_type: str = "model") -> dict:
    """Check that `repo_id` can be loaded; return extra from_pretrained kwargs.

    Returns ``{}`` when the hub is reachable, ``{"local_files_only": True}`` when it is not but
    `probe_file` is cached. Raises a ConfigError naming `key` when neither holds.
    """
    offline = hub_offline_requested()
    if not offline and hub_reachable():
        return {}
    if is_cached(repo_id, probe_file, repo_type):
        return {"local_files_only": True}
    why = "HF_HUB_OFFLINE is set" if offline else f"the Hugging Face hub ({hub_endpoint()}) cannot be reached"
    raise ConfigError(key, repo_id, f"{why} and it is not in the local HF cache; use {alternatives}")
