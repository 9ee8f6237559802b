"""AWS Signature Version 4 for S3 GET requests (the headers to add), from the algorithm's definition.

Only what reading a bucket needs: GET with an empty payload, headers host / x-amz-content-sha256 /
x-amz-date (/ x-amz-security-token) plus any extra headers the caller signs. Checked against AWS's
published S3 examples in tests/test_model_acquire.py.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
import urllib.parse

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _quote(s: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(s, safe=safe)


def sign_request(
    method: str,
    url: str,
    *,
    region: str,
    service: str,
    access_key: str,
    secret_key: str,
    session_token: str | None = None,
    extra_headers: dict[str, str] | None = None,
    now: _dt.datetime | None = None,
) -> dict[str, str]:
    """Headers (Authorization, x-amz-*) that sign `method url` for `service` in `region`."""
    parts = urllib.parse.urlsplit(url)
    now = now or _dt.datetime.now(_dt.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {"host": parts.netloc, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": amz_date}
    if session_token:
        headers["x-amz-security-token"] = session_token
    for k, v in (extra_headers or {}).items():
        headers[k.lower()] = v
    signed = sorted(headers)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted((k, v) for k, v in pairs))
    path = _quote(urllib.parse.unquote(parts.path or "/"), safe="/-_.~")
    canonical = "\n".join([
        method,
        path,
        query,
        "".join(f"{k}:{' '.join(str(headers[k]).split())}\n" for k in signed),
        ";".join(signed),
        EMPTY_SHA256,
    ])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])

    def h(key: bytes, msg: str) -> bytes:
        return hmac.new(key, msg.encode(), hashlib.sha256).digest()

    key = h(h(h(h(("AWS4" + secret_key).encode(), day), region), service), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out = {k: v for k, v in headers.items() if k != "host"}
    out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, "
                            f"SignedHeaders={';'.join(signed)}, Signature={signature}")
    return out
