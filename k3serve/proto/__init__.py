"""The worker's gRPC protocol: worker.proto and its generated modules (scripts/gen-proto.sh)."""
