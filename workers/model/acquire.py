"""`--model` as a URI: fetch the checkpoint into `$K3SERVE_HOME` once, then serve the local directory.

`resolve_model(model, revision)` returns a local checkpoint directory for

* a path (or `file://PATH`): itself;
* `hf://ORG/NAME`: the Hugging Face Hub HTTP API at `$HF_ENDPOINT` (default https://huggingface.co),
  at `revision` (branch, tag or commit; `$K3SERVE_MODEL_REVISION`, default `main`), pinned to the
  commit the revision names; token `$HF_TOKEN`. Every file is checked against the hub's sha256 (LFS
  files) or git blob id (the others). `*.bin/*.pt/*.pth/*.h5/*.msgpack/*.onnx` weights are skipped when
  the repository has safetensors;
* `s3://BUCKET/PREFIX`: S3's REST API (ListObjectsV2 + GET) at `$AWS_ENDPOINT_URL_S3` /
  `$AWS_ENDPOINT_URL` (default the bucket's virtual host in `$AWS_REGION`), signed with Signature V4 when
  `$AWS_ACCESS_KEY_ID`/`$AWS_SECRET_ACCESS_KEY` (and `$AWS_SESSION_TOKEN`) are set, anonymous otherwise;
  single-part ETags (the object's MD5) are checked;
* `gs://BUCKET/PREFIX`: the Cloud Storage JSON API at `$STORAGE_EMULATOR_HOST` (default
  https://storage.googleapis.com), bearer token `$GOOGLE_OAUTH_ACCESS_TOKEN` or anonymous; each object's
  `md5Hash` is checked;
* `https://...{.tar,.tar.gz,.tgz}` (or `http://`): one archive of the checkpoint directory, checked
  against a `#sha256=HEX` fragment when the URI has one, extracted with tarfile's `data` filter.

Layout: `$K3SERVE_HOME/models/<scheme>/<name>/<version>/` plus a `.k3serve-complete` marker; files
download into `<version>.incomplete/` (resumable: a restarted pod continues where it stopped) and the
directory is renamed into place when every file is verified. A revision already complete is used
without contacting the source, and an hf:// revision resolved before is reused when the hub cannot be
reached. Revisions apply to hf:// only (the others name one version by their URI).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import shutil
import tarfile
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from k3serve.workers.model.download import AcquireError, Checksum, fetch, get_bytes, public_url
from k3serve.workers.model.paths import model_cache_dir
from k3serve.workers.model.sigv4 import sign_request

__all__ = ["AcquireError", "resolve_model", "is_remote"]

SCHEMES = ("hf", "s3", "gs", "https", "http")
COMPLETE = ".k3serve-complete"
DEFAULT_REVISION = "main"
NON_SAFETENSORS_WEIGHTS = (".bin", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ckpt")
ARCHIVES = (".tar", ".tar.gz", ".tgz")


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative path inside the checkpoint directory
    url: str
    size: int | None
    checksum: Checksum | None
    headers: dict | Callable[[], dict]  # a function: called before each attempt (signatures expire)


def is_remote(model: str) -> bool:
    return urllib.parse.urlsplit(model).scheme in SCHEMES


def resolve_model(
    model: str, revision: str | None = None, *, home: Path | None = None, log: Callable[[str], None] = print
) -> Path:
    """A local checkpoint directory for `model` (a path or a URI); raises AcquireError."""
    parts = urllib.parse.urlsplit(model)
    if parts.scheme == "file":
        return Path(urllib.parse.unquote(parts.path))
    if parts.scheme not in SCHEMES:
        if parts.scheme and len(parts.scheme) > 1:
            raise AcquireError(f"{model}: unsupported model URI scheme {parts.scheme!r} "
                               f"(use a path, file://, hf://, s3://, gs:// or https://)")
        return Path(model)
    revision = revision or os.environ.get("K3SERVE_MODEL_REVISION") or DEFAULT_REVISION
    root = (home or model_cache_dir()) / "models"
    if parts.scheme == "hf":
        return _resolve_hf(parts, revision, root, log)
    if parts.scheme == "s3":
        return _resolve_listing(model, root / "s3" / _slug(parts.netloc + parts.path), _s3_files(parts), log)
    if parts.scheme == "gs":
        return _resolve_listing(model, root / "gs" / _slug(parts.netloc + parts.path), _gs_files(parts), log)
    return _resolve_archive(model, root, log)


def _slug(text: str) -> str:
    return "--".join(p for p in text.strip("/").split("/") if p) or "root"


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """One fetcher per target directory (two workers sharing a cache volume take turns)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def _download_all(model: str, target: Path, files: list[RemoteFile], log) -> Path:
    """Every file into target.incomplete/, verified, then target/ (atomically, with the marker)."""
    if not files:
        raise AcquireError(f"{model}: no files found")
    if not any(f.path == "config.json" for f in files):
        raise AcquireError(f"{model}: not a checkpoint (no config.json among {len(files)} files)")
    staging = target.with_name(target.name + ".incomplete")
    total = sum(f.size or 0 for f in files)
    log(f"k3serve: fetching {model} ({len(files)} files, {total} bytes) into {target}")
    for f in files:
        dest = staging / f.path
        if not _inside(staging, dest):
            raise AcquireError(f"{model}: refusing file path {f.path!r} outside the model directory")
        if dest.is_file() and (f.size is None or dest.stat().st_size == f.size):
            continue  # verified in an earlier run (files are renamed into place only once verified)
        fetch(f.url, dest, headers=f.headers, size=f.size, checksum=f.checksum)
    (staging / COMPLETE).write_text(json.dumps({"source": public_url(model) if "://" in model else model,
                                                "files": len(files), "bytes": total}))
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return target


def _inside(root: Path, path: Path) -> bool:
    root_r, path_r = os.path.realpath(root), os.path.realpath(path)
    return path_r.startswith(root_r.rstrip("/") + "/")


# --- hf:// -------------------------------------------------------------------------------------------


def _hf_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _hf_headers() -> dict:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _resolve_hf(parts: urllib.parse.SplitResult, revision: str, root: Path, log) -> Path:
    repo = (parts.netloc + parts.path).strip("/")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise AcquireError(f"hf://{repo}: expected hf://ORG/NAME")
    base = root / "hf" / repo.replace("/", "--")
    ref = base / "refs" / urllib.parse.quote(revision, safe="")
    endpoint, headers = _hf_endpoint(), _hf_headers()
    info_url = (f"{endpoint}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}"
                f"?blobs=true")
    try:
        info = json.loads(get_bytes(info_url, headers, what=f"hf://{repo}@{revision}"))
    except AcquireError as e:
        if ref.is_file() and _complete(base / ref.read_text().strip()):
            log(f"k3serve: note: {e}; using the copy of hf://{repo}@{revision} fetched before")
            return base / ref.read_text().strip()
        raise
    sha = info.get("sha")
    if not sha or not isinstance(info.get("siblings"), list):
        raise AcquireError(f"hf://{repo}@{revision}: unexpected answer from {endpoint} (no sha/siblings)")
    target = base / sha
    with _locked(target):
        if not _complete(target):
            files = _hf_files(repo, sha, info["siblings"], endpoint, headers)
            _download_all(f"hf://{repo}@{revision}", target, files, log)
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(sha)
    return target


def _hf_files(repo: str, sha: str, siblings: list[dict], endpoint: str, headers: dict) -> list[RemoteFile]:
    names = [s["rfilename"] for s in siblings]
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    files = []
    for s in siblings:
        name = s["rfilename"]
        if name.startswith(".") or (has_safetensors and name.endswith(NON_SAFETENSORS_WEIGHTS)):
            continue  # .gitattributes and weights in formats the loader does not read
        lfs = s.get("lfs") or {}
        if lfs.get("sha256"):
            checksum, size = Checksum("sha256", lfs["sha256"]), lfs.get("size", s.get("size"))
        elif s.get("blobId"):
            checksum, size = Checksum("git-sha1", s["blobId"]), s.get("size")
        else:
            checksum, size = None, s.get("size")
        url = f"{endpoint}/{repo}/resolve/{sha}/{urllib.parse.quote(name)}"
        files.append(RemoteFile(name, url, size, checksum, headers))
    return files


# --- s3:// and gs:// (a prefix of objects) ------------------------------------------------------------


def _resolve_listing(model: str, target: Path, lister: Callable[[], list[RemoteFile]], log) -> Path:
    with _locked(target):
        if _complete(target):
            return target
        return _download_all(model, target, lister(), log)


def _s3_files(parts: urllib.parse.SplitResult) -> Callable[[], list[RemoteFile]]:
    bucket, prefix = parts.netloc, parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "").rstrip("/")
    base = f"{endpoint}/{bucket}" if endpoint else f"https://{bucket}.s3.{region}.amazonaws.com"

    def signed(url: str) -> dict:
        key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not (key and secret):
            return {}
        return sign_request("GET", url, region=region, service="s3", access_key=key, secret_key=secret,
                            session_token=os.environ.get("AWS_SESSION_TOKEN"))

    def lister() -> list[RemoteFile]:
        ns = "{http://s3.amazonaws.com/doc/2006-03-01/}"
        files, token = [], None
        while True:
            q = {"list-type": "2", "prefix": prefix}
            if token:
                q["continuation-token"] = token
            url = f"{base}/?{urllib.parse.urlencode(q, quote_via=urllib.parse.quote)}"
            try:
                tree = ET.fromstring(get_bytes(url, signed(url), what=f"s3://{bucket}/{prefix}"))
            except ET.ParseError as e:
                raise AcquireError(f"s3://{bucket}/{prefix}: unreadable ListObjectsV2 answer: {e}") from None
            for c in tree.iter(f"{ns}Contents"):
                key = c.findtext(f"{ns}Key")
                if key.endswith("/"):
                    continue
                etag = (c.findtext(f"{ns}ETag") or "").strip('"')
                checksum = Checksum("md5", etag) if len(etag) == 32 and "-" not in etag else None
                url_obj = f"{base}/{urllib.parse.quote(key)}"
                files.append(RemoteFile(key[len(prefix):], url_obj, int(c.findtext(f"{ns}Size")), checksum,
                                        lambda u=url_obj: signed(u)))
            token = tree.findtext(f"{ns}NextContinuationToken")
            if tree.findtext(f"{ns}IsTruncated") != "true" or not token:
                return files

    return lister


def _gs_files(parts: urllib.parse.SplitResult) -> Callable[[], list[RemoteFile]]:
    bucket, prefix = parts.netloc, parts.path.lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    endpoint = (os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com").rstrip("/")
    token = os.environ.get("GOOGLE_OAUTH_ACCESS_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def lister() -> list[RemoteFile]:
        files, page = [], None
        while True:
            q = {"prefix": prefix, "fields": "items(name,size,md5Hash),nextPageToken"}
            if page:
                q["pageToken"] = page
            url = f"{endpoint}/storage/v1/b/{urllib.parse.quote(bucket)}/o?{urllib.parse.urlencode(q)}"
            listing = json.loads(get_bytes(url, headers, what=f"gs://{bucket}/{prefix}"))
            for item in listing.get("items", []):
                name = item["name"]
                if name.endswith("/"):
                    continue
                md5 = item.get("md5Hash")
                checksum = Checksum("md5", base64.b64decode(md5).hex()) if md5 else None
                obj = f"{endpoint}/storage/v1/b/{urllib.parse.quote(bucket)}/o/{urllib.parse.quote(name, safe='')}"
                files.append(RemoteFile(name[len(prefix):], obj + "?alt=media", int(item["size"]), checksum,
                                        headers))
            page = listing.get("nextPageToken")
            if not page:
                return files

    return lister


# --- https:// archives --------------------------------------------------------------------------------


def _resolve_archive(model: str, root: Path, log) -> Path:
    parts = urllib.parse.urlsplit(model)
    if not parts.path.endswith(ARCHIVES):
        raise AcquireError(f"{public_url(model)}: an https:// model URI names a .tar, .tar.gz or .tgz archive "
                           "of the checkpoint directory")
    frag = urllib.parse.parse_qs(parts.fragment)
    checksum = Checksum("sha256", frag["sha256"][0]) if frag.get("sha256") else None
    url = urllib.parse.urlunsplit(parts._replace(fragment=""))
    # one copy per URL and expected digest: a changed #sha256= fetches (and checks) again
    key = url + (f"#sha256={checksum.hexdigest}" if checksum else "")
    target = root / "https" / hashlib.sha256(key.encode()).hexdigest()[:24]
    with _locked(target):
        if _complete(target):
            return _checkpoint_dir(target)
        staging = target.with_name(target.name + ".incomplete")
        archive = target.with_name(target.name + ".archive")
        log(f"k3serve: fetching {public_url(url)} into {target}")
        fetch(url, archive, checksum=checksum)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        try:
            with tarfile.open(archive) as tar:
                tar.extractall(staging, filter="data")
        except (tarfile.TarError, OSError) as e:
            raise AcquireError(f"{public_url(url)}: cannot extract the archive: {e}") from None
        (staging / COMPLETE).write_text(json.dumps({"source": public_url(url)}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
        archive.unlink()
    return _checkpoint_dir(target)


def _checkpoint_dir(root: Path) -> Path:
    """The extracted directory holding config.json: the root, or its single top-level folder."""
    if (root / "config.json").is_file():
        return root
    subdirs = [p for p in root.iterdir() if p.is_dir()]
    if len(subdirs) == 1 and (subdirs[0] / "config.json").is_file():
        return subdirs[0]
    raise AcquireError(f"{root}: the archive holds no config.json (at its top or in one top-level folder)")


# --- the worker's use ---------------------------------------------------------------------------------


def prepare_worker_model(args) -> str | None:
    """Pod contract (docs/components.md) for `k3serve worker`: a `--model` URI becomes the local
    directory it is fetched into (at `$K3SERVE_MODEL_REVISION`), and `$K3SERVE_SERVED_MODEL_NAME`
    names the model when `--served-model-name` is not given. Returns a one-line error, or None."""
    served = os.environ.get("K3SERVE_SERVED_MODEL_NAME")
    if served and not getattr(args, "served_model_name", None):
        args.served_model_name = [served]
    if is_remote(args.model) or args.model.startswith("file://"):
        try:
            args.model = str(resolve_model(args.model))
        except AcquireError as e:
            return f"cannot fetch the model: {e}"
        except OSError as e:  # the cache volume: full, read-only, ...
            return f"cannot fetch the model {public_url(args.model)}: {e}"
    return None
