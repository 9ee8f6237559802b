"""Binding server ports: a port that cannot be bound is one line naming the port and the flag, exit 2.

    sock = bind_or_exit("127.0.0.1", 8000, flag="--port", prog="k3serve serve")   # a bound socket
    check_port_free(host, port, flag="--grpc-port", prog="k3serve worker")       # for servers that bind themselves
    with exit_on_bind_error(host, port, flag="--metrics-port", prog="k3serve operator"):
        prometheus_client.start_http_server(port, addr=host)                     # OSError -> the same one line

The line goes to stderr, e.g. `k3serve serve: error: port 8000 on 127.0.0.1 is already in use; choose
another with --port (0 picks a free one)`, and `PortUnavailable` (a SystemExit with code 2) ends the
command without a traceback. Print a server's URL only after it listens, never before binding.
Used by `k3serve serve`, `k3serve worker` and `k3serve operator run`; the router and `k3serve up` reuse it.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import sys


class PortUnavailable(SystemExit):
    """A server port could not be bound; the message was printed; exits with status 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port); port 0 picks a free port (read it from getsockname).
    Raises OSError as `socket.bind` does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def describe(host: str, port: int, flag: str, err: OSError) -> str:
    """Why (host, port) could not be bound, and which flag changes it (one line, no 'error:' prefix)."""
    where = f"port {port} on {host}"
    if err.errno == errno.EADDRINUSE:
        why = f"{where} is already in use"
    elif err.errno == errno.EACCES:
        why = f"{where}: permission denied (ports below 1024 need privileges)"
    elif err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) or isinstance(err, socket.gaierror):
        why = f"{where}: {host} is not an address of this machine"
    else:
        why = f"{where} cannot be bound ({err.strerror or err})"
    return f"{why}; choose another with {flag} (0 picks a free one)"


def fail(prog: str, host: str, port: int, flag: str, err: OSError) -> PortUnavailable:
    """Print the one line and return the exception to raise."""
    message = f"{prog}: error: {describe(host, port, flag, err)}"
    print(message, file=sys.stderr, flush=True)
    return PortUnavailable(message)


def bind_or_exit(host: str, port: int, *, flag: str, prog: str) -> socket.socket:
    try:
        return bind_socket(host, port)
    except OSError as e:
        raise fail(prog, host, port, flag, e) from None


def check_port_free(host: str, port: int, *, flag: str, prog: str) -> None:
    """Exit (one line, status 2) unless (host, port) can be bound now; port 0 always can."""
    if port:
        bind_or_exit(host, port, flag=flag, prog=prog).close()


@contextlib.contextmanager
def exit_on_bind_error(host: str, port: int, *, flag: str, prog: str):
    """Turn an OSError from a server that binds (host, port) itself into the one line and exit 2."""
    try:
        yield
    except OSError as e:
        raise fail(prog, host, port, flag, e) from None
