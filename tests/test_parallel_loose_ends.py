"""Loose ends of multi-rank engines (workers/engine/parallel/): a node layout the worker refuses is refused
by the engine with the same message; each rank's torch threads are its share of the host's CPUs
(workers/engine/parallel/threads.py)."""

from __future__ import annotations

import argparse
import multiprocessing

import pytest
from _engine_helpers import random_model_dir

from k3serve.workers import worker
from k3serve.workers.engine.parallel.nodes import layout_problem
from k3serve.workers.llm import LLM

OPTS = dict(dtype="float64", skip_tokenizer_init=True, max_num_batched_tokens=16, block_size=16)


@pytest.mark.parametrize("kw", [dict(nnodes=2), dict(nnodes=3, tensor_parallel_size=2), dict(node_rank=1)],
                         ids=["tp1-nnodes2", "tp2-nnodes3", "node-rank1-of-1"])
def test_engine_refuses_a_node_layout_as_the_worker_does(tmp_path_factory, kw):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 55)
    tp, nnodes, node_rank = kw.get("tensor_parallel_size", 1), kw.get("nnodes", 1), kw.get("node_rank", 0)
    want = layout_problem(tp, nnodes, node_rank)
    assert want
    with pytest.raises(ValueError) as err:
        LLM(str(d), **kw, **OPTS)
    assert str(err.value) == want  # one line, the worker's words (below) in EngineArgs' spelling
    assert not multiprocessing.active_children()  # refused before any rank started
    p = argparse.ArgumentParser()
    worker.configure(p)
    flags = ["--model", str(d), "--tensor-parallel-size", str(tp), "--nnodes", str(nnodes),
             "--node-rank", str(node_rank)]
    said = worker.unsupported_layout(p.parse_args(flags))
    assert said == want.replace("nnodes", "--nnodes").replace("node_rank", "--node-rank").replace(
        "tensor_parallel_size", "--tensor-parallel-size")
