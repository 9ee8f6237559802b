#!/usr/bin/env bash
# Regenerate k3serve/proto/worker_pb2.py and worker_pb2_grpc.py from k3serve/proto/worker.proto.
# The proto is compiled from a staging tree laid out as its import package (k3serve/proto/)
# so that the generated gRPC module imports `k3serve.proto.worker_pb2`, not a bare module.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/k3serve/proto"
cp k3serve/proto/worker.proto "$stage/k3serve/proto/"
"$PY" -m grpc_tools.protoc -I "$stage" --python_out="$stage" --grpc_python_out="$stage" \
  "$stage/k3serve/proto/worker.proto"
cp "$stage/k3serve/proto/worker_pb2.py" "$stage/k3serve/proto/worker_pb2_grpc.py" k3serve/proto/
echo "generated k3serve/proto/worker_pb2.py, worker_pb2_grpc.py"
