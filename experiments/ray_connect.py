"""Starting or joining Ray for ``--backend ray`` (compare, evaluate) and RLlib training.

``ray.init(address="HOST:PORT")`` with nothing listening there does not fail: Ray retries the
connection to the cluster's GCS and logs a warning every ~40 s, for as long as one waits (a
new user's `kvsched compare --backend ray --address 127.0.0.1:1` ran for over ten minutes). A
plain TCP connection to the address, with a timeout, tells first whether anything listens.
"""

from __future__ import annotations

import socket

from kvsched.envs.sim.errors import ConfigError

#: seconds to wait for a TCP connection to a given Ray address before refusing it
CONNECT_TIMEOUT_S = 5.0


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address ``HOST:PORT`` or ``ray://HOST:PORT`` (Ray Client);
    ``None`` for the addresses Ray resolves itself (``auto``, ``local``).

    Raises:
        ConfigError: any other form, or a port that is not an integer in [1, 65535].
    """
    if address in ("auto", "local"):
        return None
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"--address={address!r} is not allowed: expected HOST:PORT (port 1-65535), "
                          "ray://HOST:PORT, auto or local")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse a Ray address at which nothing accepts a TCP connection within ``timeout_s``.

    Raises:
        ConfigError: naming the address and the socket error.
    """
    hp = host_port(address)
    if hp is None:
        return
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"--address={address!r}: no Ray cluster answers there ({e.strerror or e}; waited up to "
                          f"{timeout_s:g} s for a TCP connection); start one with `ray start --head`, or leave "
                          "--address out to run a local Ray in this process") from None


def init_ray(ray, address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (checked first: :func:`check_reachable`) or start a
    local one (``None``), unless Ray is already initialised in this process. Returns whether this
    call initialised it (the caller then shuts it down).

    Raises:
        ConfigError: an address nothing answers at.
    """
    if ray.is_initialized():
        return False
    if address is not None:
        check_reachable(address)
    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
             ignore_reinit_error=True)
    return True
