#!/usr/bin/env bash
# Idempotent installer: Debian packages (when root), .venv with the CPU torch pin, the project
# (editable) with its test dependencies pinned by constraints.txt, and the helm binary.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

need_apt=()
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v unshare >/dev/null 2>&1 || need_apt+=(util-linux)
command -v unzip >/dev/null 2>&1 || need_apt+=(unzip)
# the Mooncake wheel imports nothing without libibverbs; a real Prometheus for the dashboard tests
[ -e /usr/lib/x86_64-linux-gnu/libibverbs.so.1 ] || ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need_apt+=(libibverbs1)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
if [ "${#need_apt[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
  else
    echo "note: missing system tools (${need_apt[*]}); some tests will be skipped" >&2
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade "pip==26.3" "setuptools==84.2.1" "wheel==0.48.0"
# torch first, alone: the CPU wheel on disk (an unpinned torch would pull a CUDA build).
.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
# NIXL without its declared deps: they would pull a CUDA torch; the CPU UCX backend needs none of them.
.venv/bin/python -m pip install -q --no-deps -c constraints.txt "nixl-cu12==1.5.1"
# the Ray launcher (--distributed-executor-backend ray; workers/engine/parallel/ray_launcher.py): CPU wheel
.venv/bin/python -m pip install -q -c constraints.txt "ray==2.60.0"
# test-only tools, not in the images: the Dockerfile parser of tests/test_dockerfile.py
.venv/bin/python -m pip install -q -c constraints.txt "dockerfile-parse==2.0.1"
bash scripts/install-helm.sh || echo "note: helm could not be installed; helm tests will be skipped" >&2
echo "k3serve installed in .venv"
