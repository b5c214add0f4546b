"""Starting or joining Ray for ``--backend ray`` (compare, evaluate) and RLlib training.

``ray.init(address="HOST:PORT")`` with nothing listening there does not fail: Ray retries the
connection to the cluster's GCS and logs a warning every ~40 s, for as long as one waits (a
new user's `kvsched compare --backend ray --address 127.0.0.1:1` ran for over ten minutes). A
plain TCP connection to the address, with a timeout, tells first whether anything listens; a
gRPC handshake (Ray's GCS and Ray Client speak gRPC) tells whether what listens could be Ray:
at a port that accepts TCP but is something else (the dashboard's 8265, a web server) Ray
waits forever too. Ray reads ``RAY_ADDRESS`` when no address is given: it is checked alike.
"""

from __future__ import annotations

import os
import socket

from kvsched.envs.sim.errors import ConfigError, bounded_repr

#: seconds to wait for a TCP connection to a given Ray address before refusing it
CONNECT_TIMEOUT_S = 5.0


def host_port(address: str, flag: str = "--address") -> tuple[str, int] | None:
    """``(host, port)`` of a Ray address ``HOST:PORT`` or ``ray://HOST:PORT`` (Ray Client);
    ``None`` for the addresses Ray resolves itself (``auto``, ``local``). ``flag`` names where
    the address came from in errors.

    Raises:
        ConfigError: any other form, or a port that is not an integer in [1, 65535].
    """
    if address in ("auto", "local"):
        return None
    rest = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{flag}={bounded_repr(address)} is not allowed: expected HOST:PORT (port 1-65535), "
                          "ray://HOST:PORT, auto or local")
    return host.strip("[]"), int(port)


def _speaks_grpc(host: str, port: int, timeout_s: float) -> bool:
    """Whether a gRPC channel to ``host:port`` becomes ready within ``timeout_s`` (the HTTP/2
    handshake; no call is made). ``True`` when it cannot be told: grpc missing, or Ray's TLS
    (``RAY_USE_TLS``), whose handshake a plain channel cannot make."""
    if os.environ.get("RAY_USE_TLS", "0").lower() not in ("", "0", "false"):
        return True
    try:
        import grpc  # a dependency of Ray
    except ImportError:
        return True
    channel = grpc.insecure_channel(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S, flag: str = "--address") -> None:
    """Refuse a Ray address at which nothing accepts a TCP connection within ``timeout_s``, or
    whatever accepts it does not complete a gRPC handshake within ``timeout_s`` (not Ray).
    ``flag`` names where the address came from (``--address`` or ``RAY_ADDRESS``).

    Raises:
        ConfigError: naming the address and the socket error, or saying that it is not Ray.
    """
    hp = host_port(address, flag)
    if hp is None:
        return
    instead = ("leave --address out to run a local Ray in this process" if flag == "--address"
               else "unset RAY_ADDRESS to run a local Ray in this process")
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            pass
    except OSError as e:
        raise ConfigError(f"{flag}={bounded_repr(address)}: no Ray cluster answers there "
                          f"({e.strerror or e}; waited up to "
                          f"{timeout_s:g} s for a TCP connection); start one with `ray start --head`, or "
                          f"{instead}") from None
    if not _speaks_grpc(*hp, timeout_s):
        raise ConfigError(f"{flag}={bounded_repr(address)}: something accepts TCP connections there "
                          "but it is not a Ray cluster "
                          f"(no gRPC handshake within {timeout_s:g} s; Ray would wait for it forever); Ray's GCS "
                          "listens on port 6379 unless `ray start --head --port` says otherwise, Ray Client on 10001 "
                          f"(ray://HOST:10001), the dashboard's 8265 is neither; or {instead}")


def init_ray(ray, address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (checked first: :func:`check_reachable`) or, for
    ``None``, at ``RAY_ADDRESS`` when that is set (as Ray does; checked alike), else start a
    local one, unless Ray is already initialised in this process. Returns whether this call
    initialised it (the caller then shuts it down).

    Raises:
        ConfigError: an address (or ``RAY_ADDRESS``) nothing answers at, or not a Ray cluster;
            ``auto`` with no Ray cluster running on this machine.
    """
    if ray.is_initialized():
        return False
    if address is not None:
        check_reachable(address)
    elif os.environ.get("RAY_ADDRESS"):
        check_reachable(os.environ["RAY_ADDRESS"], flag="RAY_ADDRESS")
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 ignore_reinit_error=True)
    except ConnectionError as e:  # `auto` with no cluster on this machine (Ray: "Could not find any ...")
        raise ConfigError(f"--address={bounded_repr(address)}: {str(e).splitlines()[0]}") from None
    return True
