"""One file over HTTP(S) into place: resumable, verified, retried, with errors that say what failed.

`fetch(url, dest, size=, checksum=)` downloads into `dest.part`, resuming with a `Range` request after a
dropped connection (or a restarted pod: the `.part` file stays in `$K3SERVE_HOME`), checks the size and
the checksum the source published, and renames the file into place only when both match. Transient
failures (connection errors, timeouts, HTTP 408/429/5xx) are retried with backoff; anything else raises
`AcquireError` with the URL (query string and credentials left out) and the HTTP status.
Uses only the standard library (urllib), so the image needs nothing more.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20
RETRYABLE_HTTP = {408, 429, 500, 502, 503, 504}
BACKOFF_S = 0.5  # first retry delay; doubles up to 10 s


class AcquireError(Exception):
    """A model could not be fetched; the message is one line for the user."""


@dataclass(frozen=True)
class Checksum:
    """What the source says the file hashes to. algo: sha256 | md5 | git-sha1 (a git blob id)."""

    algo: str
    hexdigest: str

    def of_file(self, path: Path) -> str:
        if self.algo == "git-sha1":
            h = hashlib.sha1()
            h.update(b"blob %d\0" % path.stat().st_size)
        else:
            h = hashlib.new(self.algo)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        return h.hexdigest()


def public_url(url: str) -> str:
    """The URL as it may be printed: no user info, no query string (presigned URLs carry secrets)."""
    p = urllib.parse.urlsplit(url)
    host = p.hostname or ""
    if p.port:
        host += f":{p.port}"
    return urllib.parse.urlunsplit((p.scheme, host, p.path, "", ""))


class _SameHostAuthRedirect(urllib.request.HTTPRedirectHandler):
    """Follow redirects (hubs send downloads to a CDN) but never carry Authorization to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            for key in list(new.headers):
                if key.lower() == "authorization":
                    del new.headers[key]
            new.unredirected_hdrs.pop("Authorization", None)
        return new


_OPENER = urllib.request.build_opener(_SameHostAuthRedirect())


def open_url(url: str, headers: dict[str, str] | None = None, *, timeout: float = 60.0):
    """urlopen with our redirect policy; HTTP errors raise urllib.error.HTTPError."""
    return _OPENER.open(urllib.request.Request(url, headers=dict(headers or {})), timeout=timeout)


def get_bytes(url: str, headers: dict[str, str] | None = None, *, retries: int = 4, what: str = "") -> bytes:
    """A small GET (an API listing), retried like `fetch`."""

    def once():
        with open_url(url, headers) as resp:
            return resp.read()

    return _retrying(once, url, retries, what)


def _retrying(fn, url: str, retries: int, what: str):
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            return fn()
        except urllib.error.HTTPError as e:
            if e.code not in RETRYABLE_HTTP:
                raise AcquireError(http_error_message(url, e, what)) from None
            last = e
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            last = e
        if attempt < retries:
            time.sleep(min(BACKOFF_S * 2**attempt, 10.0))
    raise AcquireError(f"{what or public_url(url)}: failed after {retries + 1} attempts: {_reason(last)}")


def _reason(e: Exception | None) -> str:
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code} {e.reason}"
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    return f"{type(e).__name__}: {e}" if e else "unknown error"


def http_error_message(url: str, e: urllib.error.HTTPError, what: str = "") -> str:
    hint = {
        401: " (authentication required: see docs/kubernetes.md, 'Model sources')",
        403: " (access denied: check the credentials and that they may read this model)",
        404: " (not found: check the URI and the revision)",
    }.get(e.code, "")
    return f"{what or public_url(url)}: HTTP {e.code} {e.reason}{hint}"


def fetch(
    url: str,
    dest: Path,
    *,
    headers: dict[str, str] | Callable[[], dict[str, str]] | None = None,
    size: int | None = None,
    checksum: Checksum | None = None,
    retries: int = 4,
    timeout: float = 60.0,
) -> None:
    """Download `url` to `dest` (resuming `dest.part`); verify `size` and `checksum` when given.

    `headers` may be a function, called before every attempt (request signatures expire).
    """
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    for fresh_start in (False, True):
        if fresh_start:
            part.unlink(missing_ok=True)
        _retrying(lambda: _transfer(url, part, headers, size, timeout), url, retries, "")
        problem = _verify(part, size, checksum)
        if problem is None:
            os.replace(part, dest)
            return
    part.unlink(missing_ok=True)
    raise AcquireError(f"{public_url(url)}: {problem}")


def _transfer(url: str, part: Path, headers, size: int | None, timeout: float) -> None:
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        part.unlink()
        have = 0
    if size is not None and have == size:
        return
    h = dict((headers() if callable(headers) else headers) or {})
    if have:
        h["Range"] = f"bytes={have}-"
    try:
        resp = open_url(url, h, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing left to send: the part is complete (verified next)
            return
        raise
    with resp:
        append = bool(have) and resp.status == 206
        expected = resp.headers.get("Content-Length")
        written = 0
        with open(part, "ab" if append else "wb") as f:
            while chunk := resp.read(CHUNK):
                f.write(chunk)
                written += len(chunk)
        if expected is not None and written != int(expected):
            raise http.client.IncompleteRead(b"", int(expected) - written)


def _verify(part: Path, size: int | None, checksum: Checksum | None) -> str | None:
    got_size = part.stat().st_size
    if size is not None and got_size != size:
        return f"size mismatch: expected {size} bytes, got {got_size}"
    if checksum is not None:
        got = checksum.of_file(part)
        if got != checksum.hexdigest.lower():
            return f"{checksum.algo} mismatch: expected {checksum.hexdigest}, got {got}"
    return None
