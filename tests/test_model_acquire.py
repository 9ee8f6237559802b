"""Model acquisition (workers/model/acquire.py): hf://, s3://, gs://, https:// archives and file://
fetched from local servers imitating each source's HTTP API (tests/_model_sources.py): files land
byte-identical, checksums are checked, downloads resume, failures are one clear line, and secrets
never reach another host or a message."""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from k3serve.workers.model import acquire, download
from k3serve.workers.model.acquire import AcquireError, prepare_worker_model, resolve_model
from k3serve.workers.model.download import Checksum, fetch
from k3serve.workers.model.sigv4 import sign_request

from ._model_sources import FakeSources

FILES = {
    "config.json": b'{"model_type": "k3"}',
    "tokenizer.json": b'{"version": "1.0"}' * 50,
    "model-00001-of-00002.safetensors": os.urandom(300_000),
    "model-00002-of-00002.safetensors": os.urandom(200_001),
    "pytorch_model.bin": b"unused weights",
}
WANTED = {k: v for k, v in FILES.items() if not k.endswith(".bin")}
TOKEN = "hf_secret_token_value"


@pytest.fixture
def sources():
    with FakeSources(FILES) as s:
        yield s


@pytest.fixture
def env(monkeypatch, tmp_path):
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                "AWS_SESSION_TOKEN", "GOOGLE_OAUTH_ACCESS_TOKEN", "K3SERVE_MODEL_REVISION",
                "K3SERVE_SERVED_MODEL_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("K3SERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(download, "BACKOFF_S", 0.01)
    return monkeypatch


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.startswith(".")}


def test_hf_downloads_the_pinned_commit_and_checks_every_file(sources, env, tmp_path):
    env.setenv("HF_ENDPOINT", sources.url)
    env.setenv("HF_TOKEN", TOKEN)
    env.setenv("K3SERVE_MODEL_REVISION", "main")
    logs: list[str] = []
    path = resolve_model("hf://org/tiny", log=logs.append)
    assert path == tmp_path / "home/models/hf/org--tiny" / sources.sha
    assert _tree(path) == WANTED  # .bin skipped next to safetensors, .gitattributes skipped
    assert (path / ".k3serve-complete").is_file()
    assert (path.parent / "refs/main").read_text() == sources.sha
    assert any("fetching hf://org/tiny@main" in line for line in logs)
    # the token goes to the hub, never to the CDN it redirects to; downloads name the commit, not "main"
    hub = [r for r in sources.requests if r["host"].startswith("127.0.0.1")]
    cdn = [r for r in sources.requests if r["host"].startswith("localhost")]
    assert hub and cdn
    assert all(r["headers"].get("authorization") == f"Bearer {TOKEN}" for r in hub)
    assert all("authorization" not in r["headers"] for r in cdn)
    assert all(f"/resolve/{sources.sha}/" in r["path"] for r in hub if "/resolve/" in r["path"])
    # complete: a second resolve lists the revision again but downloads nothing
    n = len(sources.requests)
    assert resolve_model("hf://org/tiny") == path
    assert [r["path"] for r in sources.requests[n:]] == [
        "/api/models/org/tiny/revision/main?blobs=true"
    ]


def test_hf_offline_reuses_a_revision_fetched_before(sources, env):
    env.setenv("HF_ENDPOINT", sources.url)
    path = resolve_model("hf://org/tiny", "main")
    env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the hub is unreachable
    logs: list[str] = []
    assert resolve_model("hf://org/tiny", "main", log=logs.append) == path
    assert any("fetched before" in line for line in logs)
    with pytest.raises(AcquireError, match=r"hf://org/tiny@v2: failed after \d+ attempts"):
        resolve_model("hf://org/tiny", "v2")


def test_hf_errors_are_one_clear_line_without_the_token(sources, env):
    env.setenv("HF_ENDPOINT", sources.url)
    env.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(AcquireError) as e:
        resolve_model("hf://org/missing", "main")
    assert "hf://org/missing@main: HTTP 401" in str(e.value) and "authentication required" in str(e.value)
    with pytest.raises(AcquireError, match=r"hf://org/tiny@nope: HTTP 404 .*not found"):
        resolve_model("hf://org/tiny", "nope")
    with pytest.raises(AcquireError, match="expected hf://ORG/NAME"):
        resolve_model("hf://just-a-name")
    for msg in (str(e.value),):
        assert TOKEN not in msg


def test_hf_checksum_mismatch_fails_and_leaves_no_model(sources, env, tmp_path):
    env.setenv("HF_ENDPOINT", sources.url)
    sources.wrong_sha256.add("model-00002-of-00002.safetensors")
    with pytest.raises(AcquireError, match="sha256 mismatch: expected [0-9a-f]{64}, got [0-9a-f]{64}"):
        resolve_model("hf://org/tiny")
    base = tmp_path / "home/models/hf/org--tiny"
    assert not (base / sources.sha).exists()
    assert not list(base.rglob(".k3serve-complete"))


def test_download_resumes_after_a_dropped_connection_and_a_restart(sources, env, tmp_path):
    env.setenv("HF_ENDPOINT", sources.url)
    big = "model-00001-of-00002.safetensors"
    sources.drop_once.add(big)
    path = resolve_model("hf://org/tiny")
    assert (path / big).read_bytes() == FILES[big]
    gets = [r for r in sources.requests if r["path"] == f"/cdn/{big}"]
    assert len(gets) == 2 and "range" not in gets[0]["headers"]
    assert gets[1]["headers"]["range"] == f"bytes={len(FILES[big]) // 2}-"
    # a pod restarted mid-download: the .part file in $K3SERVE_HOME is continued, not restarted
    dest = tmp_path / "restart" / big
    dest.parent.mkdir()
    (dest.parent / (big + ".part")).write_bytes(FILES[big][:1000])
    n = len(sources.requests)
    fetch(f"{sources.cdn_url}/cdn/{big}", dest, size=len(FILES[big]),
          checksum=Checksum("sha256", hashlib.sha256(FILES[big]).hexdigest()))
    assert dest.read_bytes() == FILES[big]
    assert sources.requests[n]["headers"]["range"] == "bytes=1000-"
    assert not (dest.parent / (big + ".part")).exists()


def test_a_stale_partial_file_is_fetched_again_when_its_checksum_fails(sources, tmp_path):
    name = "tokenizer.json"
    dest = tmp_path / name
    (tmp_path / (name + ".part")).write_bytes(b"X" * 10)  # garbage from another version
    fetch(f"{sources.url}/cdn/{name}", dest, size=len(FILES[name]),
          checksum=Checksum("git-sha1", sources.hub_info()["siblings"][2]["blobId"]))
    assert dest.read_bytes() == FILES[name]


def test_s3_listing_pages_md5_and_signature(sources, env, tmp_path):
    env.setenv("AWS_ENDPOINT_URL_S3", sources.url)
    path = resolve_model("s3://bucket/models/tiny")
    assert _tree(path) == FILES
    lists = [r for r in sources.requests if "list-type=2" in r["path"]]
    assert len(lists) == 3 and "continuation-token=4" in lists[-1]["path"]  # 5 objects, 2 a page
    assert all("authorization" not in r["headers"] for r in sources.requests)  # anonymous
    # with credentials every request is signed (Signature V4)
    env.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    env.setenv("AWS_SECRET_ACCESS_KEY", "secret-key")
    env.setenv("AWS_REGION", "eu-west-1")
    n = len(sources.requests)
    resolve_model("s3://bucket/models/tiny2")  # another prefix: the fake serves the same objects
    signed = sources.requests[n:]
    assert signed and all(
        r["headers"]["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/")
        and "/eu-west-1/s3/aws4_request" in r["headers"]["authorization"]
        and r["headers"]["x-amz-content-sha256"] == hashlib.sha256(b"").hexdigest()
        for r in signed
    )


def test_s3_corrupt_object_fails_its_etag(sources, env, tmp_path):
    env.setenv("AWS_ENDPOINT_URL_S3", sources.url)
    sources.corrupt.add("tokenizer.json")
    with pytest.raises(AcquireError, match=r"/bucket/m/tokenizer.json: md5 mismatch: expected [0-9a-f]{32}"):
        resolve_model("s3://bucket/m")
    assert not (tmp_path / "home/models/s3/bucket--m").exists()


def test_sigv4_matches_the_published_s3_examples():
    kw = dict(region="us-east-1", service="s3", access_key="AKIAIOSFODNN7EXAMPLE",
              secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC))
    get = sign_request("GET", "https://examplebucket.s3.amazonaws.com/test.txt",
                       extra_headers={"Range": "bytes=0-9"}, **kw)
    assert get["Authorization"].endswith(
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")
    listing = sign_request("GET", "https://examplebucket.s3.amazonaws.com/?max-keys=2&prefix=J", **kw)
    assert listing["Authorization"].endswith(
        "Signature=34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7")


def test_gs_listing_and_md5(sources, env):
    env.setenv("STORAGE_EMULATOR_HOST", sources.url)
    env.setenv("GOOGLE_OAUTH_ACCESS_TOKEN", "ya29.token")
    path = resolve_model("gs://bucket/models/tiny")
    assert _tree(path) == FILES
    media = [r for r in sources.requests if "alt=media" in r["path"]]
    assert len(media) == len(FILES)
    assert all(r["headers"]["authorization"] == "Bearer ya29.token" for r in sources.requests)


def _tarball(files: dict[str, bytes], top: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_https_archive_with_sha256_fragment(sources, env):
    blob = _tarball(WANTED, "tiny")
    sources.archives["tiny.tar.gz"] = blob
    sources.drop_once.add("archive:tiny.tar.gz")
    digest = hashlib.sha256(blob).hexdigest()
    path = resolve_model(f"{sources.url}/archives/tiny.tar.gz#sha256={digest}")
    assert path.name == "tiny" and _tree(path) == WANTED
    assert resolve_model(f"{sources.url}/archives/tiny.tar.gz#sha256={digest}") == path  # cached
    with pytest.raises(AcquireError, match="sha256 mismatch"):
        resolve_model(f"{sources.url}/archives/tiny.tar.gz#sha256={'0' * 64}")
    with pytest.raises(AcquireError, match=r"archives/nope.tgz: HTTP 404"):
        resolve_model(f"{sources.url}/archives/nope.tgz")
    with pytest.raises(AcquireError, match="names a .tar, .tar.gz or .tgz archive"):
        resolve_model(f"{sources.url}/models/tiny?sig=secret")


def test_https_archive_escaping_its_directory_is_refused(sources, env):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../evil")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    sources.archives["evil.tar"] = buf.getvalue()
    with pytest.raises(AcquireError, match="cannot extract the archive"):
        resolve_model(f"{sources.url}/archives/evil.tar")


def test_paths_and_bad_schemes(tmp_path, env):
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(f"file://{tmp_path}") == tmp_path
    with pytest.raises(AcquireError, match="unsupported model URI scheme 'ftp'"):
        resolve_model("ftp://host/model")


def test_worker_hook_resolves_the_uri_and_the_served_name(sources, env):
    env.setenv("HF_ENDPOINT", sources.url)
    env.setenv("K3SERVE_SERVED_MODEL_NAME", "k3-tiny")
    args = argparse.Namespace(model="hf://org/tiny", served_model_name=None)
    assert prepare_worker_model(args) is None
    assert Path(args.model).name == sources.sha and args.served_model_name == ["k3-tiny"]
    args = argparse.Namespace(model="/models/x", served_model_name=["mine"])
    assert prepare_worker_model(args) is None and args.served_model_name == ["mine"] and args.model == "/models/x"
    args = argparse.Namespace(model="hf://org/absent", served_model_name=None)
    problem = prepare_worker_model(args)
    assert problem.startswith("cannot fetch the model: hf://org/absent@main: HTTP 401") and "\n" not in problem


def test_module_names_every_scheme_it_serves():
    assert set(acquire.SCHEMES) == {"hf", "s3", "gs", "https", "http"}
