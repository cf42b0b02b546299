"""Running a service's app on uvicorn: the listening socket (address, port; port 0 takes a free one), the
loopback check that decides whether a bearer token is required, the foreground server of a command
(:func:`serve_forever`) and the in-process server of a trainer (:class:`BackgroundServer`: real HTTP on
127.0.0.1 from a background thread, stopped by :meth:`BackgroundServer.close`).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

from shifu.errors import ConfigError, ShifuError

SERVE_EXTRA = "pip install 'shifu-rlhf[serve]' (starlette, uvicorn)"


def is_loopback(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1 literals (anything else may be reachable from outside)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None, what: str, token_env: str) -> None:
    """ConfigError when ``host`` is not a loopback address and no token guards ``what``."""
    if not is_loopback(host) and not token:
        raise ConfigError(
            f"--host {host} is not a loopback address: anyone who reaches it could use {what}. Give --token "
            f"(or ${token_env}), or bind 127.0.0.1"
        )


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one); connections queue from here on."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ShifuError(f"cannot listen on {host}:{port} ({e}); choose another --port or --host") from None
    sock.listen(512)
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def require_uvicorn():
    try:
        import uvicorn
    except ImportError:
        raise ShifuError(f"shifu's HTTP services need their extra: {SERVE_EXTRA}") from None
    return uvicorn


def serve_forever(app, sock: socket.socket, log_level: str = "info", access_log: bool = False) -> None:
    """Serve ``app`` on ``sock`` in this thread until interrupted (Ctrl-C, SIGTERM)."""
    uvicorn = require_uvicorn()
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


class BackgroundServer:
    """``app`` on uvicorn in a daemon thread, listening on ``host:port`` (port 0: a free one, read from
    :attr:`port` / :attr:`url` once started). The app's lifespan has run when the constructor returns;
    :meth:`close` stops the server and waits for its thread. Usable as a context manager. ``keep_alive_s``: how
    long an idle connection stays open (uvicorn's ``timeout_keep_alive``): a client that sends its next request
    just as the server closes the connection gets no answer, so a server whose clients pause between requests
    (an agent's tool calls) keeps their connections longer than any pause."""

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", keep_alive_s: int = 5
    ):
        uvicorn = require_uvicorn()
        self.sock = bind_socket(host, port)
        self.url = socket_url(self.sock)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_level=log_level, access_log=False, lifespan="on", timeout_keep_alive=keep_alive_s
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="shifu-http", daemon=True
        )
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.005)
        if not self.server.started:
            self.sock.close()
            raise ShifuError(f"the HTTP server on {self.url} did not start (its log says why)")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
