"""One multi-node decode group under `k3serve operator simulate` (tests/_k8s_sim.py): the custom resource of
a decode pool on 1-GPU nodes, the group's leader address from its pods' logs, a greedy completion through the
gateway, SIGKILL of one pod's process tree, the completion again once the group is back, and the offline
engine's completion of the same prompt to compare them with."""

from __future__ import annotations

import os
import re
import signal
import time

from tests._k8s_sim import sample

PROMPT, MAX_TOKENS = "The cache keeps", 6


def one_gpu_node_decode_cr(**decode) -> dict:
    """tiny-cpu.yaml with a decode pool (`decode`: its parallel sizes) with expert parallelism on 1-GPU nodes (a
    pod per node of a group), no prefill, no store."""
    cr = sample("tiny-cpu.yaml")
    cr["spec"]["prefill"]["replicas"] = 0
    cr["spec"]["kvStore"]["enabled"] = False
    cr["spec"]["decode"].update(**decode, expertParallel=True, gpusPerNode=1)
    cr["spec"]["decode"].pop("transferDevices", None)
    return cr


def group_leader_ip(sim, leader: str, node: str) -> str:
    """The group's leader pod IP, from its ready line; the node pod names it as the leader it joined."""
    ip = re.search(r"ready grpc=([\d.]+):", sim.log(leader)).group(1)
    node_log = sim.log(node)
    assert f"node 1 of 2 ready ranks=[1] leader={ip}:29500" in node_log, node_log
    return ip


def complete(sim) -> str:
    import openai

    client = openai.OpenAI(base_url=sim.gateway, api_key="none", max_retries=0, timeout=120)
    return client.completions.create(model="k3-tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def kill_pod(sim, pod: str) -> None:
    os.killpg(int((sim.root / "pods" / pod / "pid").read_text()), signal.SIGKILL)


def complete_when(sim, marker: str, timeout_s: float):
    """complete(sim) once `marker` is in the simulation's output (the group comes back), retried while the
    gateway answers an error; None if no answer came within `timeout_s`."""
    import openai

    deadline, again = time.monotonic() + timeout_s, None
    while again is None and time.monotonic() < deadline:
        if marker in sim.output():
            try:
                again = complete(sim)
            except openai.APIError:
                time.sleep(1)
        else:
            time.sleep(0.5)
    return again


def offline_completion(model_dir, **parallel) -> str:
    """The offline engine's greedy completion of PROMPT with `parallel` (e.g. tensor_parallel_size=2) and
    expert parallelism; its ranks are stopped after."""
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    llm = LLM(str(model_dir), max_model_len=512, enable_expert_parallel=True, **parallel)
    try:
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    finally:
        close = getattr(llm.engine, "close", None) or llm.engine.runner.close  # a DP engine / a TP runner
        close()
    return out.outputs[0].text
