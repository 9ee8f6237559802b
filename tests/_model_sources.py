"""Local HTTP servers standing in for the model sources no test can reach: a Hugging Face Hub (its HTTP
API: /api/models/ORG/NAME/revision/REV?blobs=true and /ORG/NAME/resolve/SHA/FILE, with a redirect to a
"CDN" on another host name), S3 (ListObjectsV2 XML + GET), Cloud Storage (JSON API) and plain HTTPS
archives. Every server honours `Range` (206) and can drop a file's connection half-way, once.

Used by tests/test_model_acquire.py and tests/test_k8s_simulate.py (hf:// checkpoints served locally).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeSources:
    """files: {relative path: bytes} of one model, served as every kind of source at once."""

    def __init__(self, files: dict[str, bytes], *, repo: str = "org/tiny", sha: str = "a" * 40,
                 lfs: tuple[str, ...] = (".safetensors",), page_size: int = 2):
        self.files = dict(files)
        self.repo, self.sha, self.lfs, self.page_size = repo, sha, lfs, page_size
        self.archives: dict[str, bytes] = {}  # /archives/<name> -> bytes
        self.drop_once: set[str] = set()  # file paths whose first GET is cut half-way
        self.wrong_sha256: set[str] = set()  # file paths the hub advertises a wrong digest for
        self.corrupt: set[str] = set()  # file paths served with one bit flipped (listings stay right)
        self.requests: list[dict] = []  # {"path", "headers"} of every request
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @classmethod
    def from_dir(cls, root: Path, **kw) -> FakeSources:
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        return cls(files, **kw)

    # endpoints --------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_url(self) -> str:  # the same server under another host name, as a hub's CDN
        return f"http://localhost:{self.port}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    # content ----------------------------------------------------------------------------------------
    def hub_info(self) -> dict:
        siblings = [{"rfilename": ".gitattributes", "blobId": git_blob_sha1(b"*.safetensors lfs\n"), "size": 18}]
        for name, data in self.files.items():
            s = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(name.encode())}
            if name.endswith(self.lfs):
                digest = hashlib.sha256(data).hexdigest()
                if name in self.wrong_sha256:
                    digest = hashlib.sha256(data + b"x").hexdigest()
                s["lfs"] = {"sha256": digest, "size": len(data), "pointerSize": 134}
            else:
                s["blobId"] = git_blob_sha1(data)
            siblings.append(s)
        return {"id": self.repo, "sha": self.sha, "siblings": siblings}

    def s3_listing(self, prefix: str, token: str | None) -> bytes:
        keys = sorted(f"{prefix}{name}" for name in self.files)
        start = int(token or 0)
        page = keys[start : start + self.page_size]
        more = start + self.page_size < len(keys)
        items = "".join(
            f"<Contents><Key>{k}</Key><Size>{len(self.files[k[len(prefix):]])}</Size>"
            f"<ETag>&quot;{hashlib.md5(self.files[k[len(prefix):]]).hexdigest()}&quot;</ETag></Contents>"
            for k in page
        )
        nxt = f"<NextContinuationToken>{start + self.page_size}</NextContinuationToken>" if more else ""
        return (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Prefix>{prefix}</Prefix><KeyCount>{len(page)}</KeyCount>"
            f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>{nxt}{items}</ListBucketResult>"
        ).encode()

    def gs_listing(self, prefix: str, token: str | None) -> bytes:
        names = sorted(self.files)
        start = int(token or 0)
        page = names[start : start + self.page_size]
        out: dict = {
            "items": [
                {
                    "name": prefix + n,
                    "size": str(len(self.files[n])),
                    "md5Hash": base64.b64encode(hashlib.md5(self.files[n]).digest()).decode(),
                }
                for n in page
            ]
        }
        if start + self.page_size < len(names):
            out["nextPageToken"] = str(start + self.page_size)
        return json.dumps(out).encode()

    # the handler ------------------------------------------------------------------------------------
    def _handler(self):
        src = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json", extra: dict | None = None):
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _file(self, key: str, data: bytes):
                if key in src.corrupt:
                    data = data[:-1] + bytes([data[-1] ^ 1])
                rng = self.headers.get("Range")
                with src.lock:
                    drop = key in src.drop_once and not rng
                    src.drop_once.discard(key) if drop else None
                start = 0
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    if start >= len(data):
                        return self._send(416, b"", extra={"Content-Range": f"bytes */{len(data)}"})
                    body = data[start:]
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    body = data
                    self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if drop:  # half the bytes, then the connection goes away
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

            def do_GET(self):  # noqa: C901 - one dispatcher for four fake services
                parts = urllib.parse.urlsplit(self.path)
                q = dict(urllib.parse.parse_qsl(parts.query))
                path = urllib.parse.unquote(parts.path)
                with src.lock:
                    src.requests.append({"path": self.path, "host": self.headers.get("Host"),
                                         "headers": {k.lower(): v for k, v in self.headers.items()}})
                # Hugging Face Hub
                api = f"/api/models/{src.repo}/revision/"
                if path.startswith(api):
                    rev = path[len(api) :]
                    if rev not in ("main", src.sha):
                        return self._send(404, b'{"error":"Revision Not Found"}')
                    return self._send(200, json.dumps(src.hub_info()).encode())
                if path.startswith("/api/models/"):
                    return self._send(401, b'{"error":"Repository Not Found"}')
                resolve = f"/{src.repo}/resolve/{src.sha}/"
                if path.startswith(resolve):
                    name = path[len(resolve) :]
                    if name not in src.files:
                        return self._send(404, b"{}")
                    return self._send(302, b"", extra={"Location": f"{src.cdn_url}/cdn/{urllib.parse.quote(name)}"})
                if path.startswith("/cdn/"):
                    name = path[len("/cdn/") :]
                    return self._file(name, src.files[name]) if name in src.files else self._send(404, b"")
                # Cloud Storage JSON API
                if path.startswith("/storage/v1/b/"):
                    rest = path[len("/storage/v1/b/") :]
                    _bucket, _, obj = rest.partition("/o")
                    if obj in ("", "/") and q.get("alt") != "media":
                        return self._send(200, src.gs_listing(q.get("prefix", ""), q.get("pageToken")))
                    name = obj.lstrip("/")
                    for fname, data in src.files.items():
                        if name.endswith("/" + fname) or name == fname:
                            return self._file(fname, data)
                    return self._send(404, b"{}")
                # plain archives
                if path.startswith("/archives/"):
                    name = path[len("/archives/") :]
                    if name in src.archives:
                        return self._file("archive:" + name, src.archives[name])
                    return self._send(404, b"")
                # S3 (path style: /BUCKET/?list-type=2... and /BUCKET/KEY)
                _bucket, _, key = path.lstrip("/").partition("/")
                if q.get("list-type") == "2":
                    return self._send(200, src.s3_listing(q.get("prefix", ""), q.get("continuation-token")),
                                      "application/xml")
                for fname, data in src.files.items():
                    if key.endswith("/" + fname) or key == fname:
                        return self._file(fname, data)
                return self._send(404, b"<Error><Code>NoSuchKey</Code></Error>", "application/xml")

        return Handler
