"""Fail fast when the Hugging Face hub cannot be reached.

`from_pretrained` / `load_dataset` on a machine without network retry for minutes before they
give up with a stack of connection errors. Before touching the hub we therefore (1) honour
``HF_HUB_OFFLINE``, (2) otherwise send one HEAD request to the hub endpoint with a 3 s
deadline. If the hub is unreachable but the files are in the local HF cache,
loading goes on from the cache; if not, one line says so and names the local alternatives.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

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
    """Whether the hub answers one HTTP HEAD request within `timeout` seconds.

    An HTTP answer of any status counts (the server is there); DNS failures, refused or reset
    connections, TLS failures (e.g. an intercepting firewall) and silence do not. A bare TCP
    connect is not enough: sandboxes and proxies accept connections they never forward. The
    request runs in a daemon thread joined with the deadline, because a hanging DNS lookup is
    not bounded by socket timeouts. urllib honours HTTPS_PROXY like huggingface_hub does. The
    answer is cached for the process: the model and the data loader both ask.
    """
    endpoint = hub_endpoint()
    if endpoint in _probe_result:
        return _probe_result[endpoint]
    result: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
            result.append(True)
        except urllib.error.HTTPError:  # 4xx/5xx: the hub is there
            result.append(True)
        except (OSError, ValueError):  # URLError, timeouts, TLS errors, a malformed endpoint
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


def require_hub(
    repo_id: str, probe_file: str, *, key: str, alternatives: str, repo_type: str = "model"
) -> dict:
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
