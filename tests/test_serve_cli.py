"""`k3serve serve` / `k3serve worker` option parsing and the API-key file."""

import argparse

import pytest

from k3serve.openai_api.errors import read_api_key_file
from k3serve.workers import serve, worker
from k3serve.workers.engine_cli import engine_args_from


def parse(module, argv):
    p = argparse.ArgumentParser()
    module.configure(p)
    return p.parse_args(argv)


def test_serve_options_map_to_engine_args():
    a = parse(serve, ["/m", "--port", "0", "--served-model-name", "a", "b", "--max-model-len", "512",
                      "--kv-cache-memory", "64M", "--enable-prefix-caching", "--prefix-cache-retention-interval",
                      "dense", "--prefix-cache-eviction", "compute-per-byte", "--dtype", "float32", "--seed", "3"])
    assert (a.model, a.host, a.port, a.served_model_name) == ("/m", "127.0.0.1", 0, ["a", "b"])
    e = engine_args_from(a, a.model)
    assert (e.model, e.max_model_len, e.kv_cache_memory, e.enable_prefix_caching) == ("/m", 512, 64 << 20, True)
    assert (e.prefix_cache_retention_interval, e.prefix_cache_eviction, e.dtype, e.seed) == \
        ("dense", "compute-per-byte", "float32", 3)
    assert e.served_model_name == "a"
    assert engine_args_from(parse(serve, ["/m", "--kv-cache-memory", "0.5"]), "/m").kv_cache_memory == 0.5
    assert engine_args_from(parse(serve, ["/m", "--prefix-cache-retention-interval", "64"]),
                            "/m").prefix_cache_retention_interval == 64


@pytest.mark.parametrize("argv", [["/m", "--kv-cache-memory", "lots"], ["/m", "--prefix-cache-retention-interval", "-1"],
                                  ["/m", "--dtype", "int3"]])
def test_serve_rejects_bad_options(argv):
    with pytest.raises(SystemExit):
        parse(serve, argv)


def test_worker_options():
    a = parse(worker, ["--model", "/m", "--role", "both", "--grpc-port", "0", "--metrics-port", "9", "--host", "127.0.0.1"])
    assert (a.model, a.role, a.grpc_port, a.metrics_port) == ("/m", "both", 0, 9)
    with pytest.raises(SystemExit):
        parse(worker, ["--model", "/m", "--role", "router"])


def test_api_key_file(tmp_path):
    f = tmp_path / "key"
    f.write_text("  s3cret\n")
    assert read_api_key_file(str(f)) == "s3cret"
    f.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key_file(str(f))
