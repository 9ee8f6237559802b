"""LLMEngine.final_outputs_only: step() returns finished requests' outputs only, the same final outputs as the
streamed mode's last ones; LLM.generate turns it on while it runs and restores it after."""

from __future__ import annotations

from k3serve.sampling_params import SamplingParams
from k3serve.workers.llm import LLM


def _drive(eng, final_only: bool):
    eng.final_outputs_only = final_only
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    params.append(SamplingParams(temperature=0.8, seed=4, max_tokens=6, n=2, ignore_eos=True))
    params.append(SamplingParams(temperature=0.0, max_tokens=8, stop=["a"], ignore_eos=True))
    for i, sp in enumerate(params):
        eng.add_request(f"r{i}", [5 + i, 9, 17, 33 + i], sp)
    seen, last = [], {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append(out.finished)
            last[out.request_id] = out
    return seen, last


def _key(out):
    return [(o.index, o.text, o.token_ids, o.finish_reason) for o in out.outputs]


def test_final_only_outputs_equal_the_streamed_finals(tiny_model_dir):
    eng = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, max_num_seqs=8).engine
    seen_all, streamed = _drive(eng, False)
    seen_final, finals = _drive(eng, True)
    assert not all(seen_all) and all(seen_final) and len(seen_final) == len(finals) == 5
    assert {r: _key(o) for r, o in finals.items()} == {r: _key(o) for r, o in streamed.items()}


def test_generate_sets_and_restores_it(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, max_num_seqs=8)
    eng = llm.engine
    flags = []
    real = eng.step
    eng.step = lambda: flags.append(eng.final_outputs_only) or real()
    outs = llm.generate([[3, 4, 5], [6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    assert flags and all(flags) and eng.final_outputs_only is False
