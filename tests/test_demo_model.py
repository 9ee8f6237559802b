"""The committed demo model (models/k3-demo-stdlib): the default serving model, within the size limits, and
through the real engine on the CPU a chat request gets non-empty content, its thinking separated, and
finishes with "stop" (one greedy request; the figures of its card come from results.json)."""

import json

import pytest
import torch

from k3serve.workers.model.paths import DEMO_MODEL_DIR, default_serving_model

torch.set_num_threads(1)


def test_demo_model_is_the_default_and_within_the_size_limits():
    assert (DEMO_MODEL_DIR / "config.json").is_file(), "models/k3-demo-stdlib is missing"
    assert default_serving_model() == DEMO_MODEL_DIR
    sizes = {f.name: f.stat().st_size for f in DEMO_MODEL_DIR.iterdir() if f.is_file()}
    assert sum(sizes.values()) <= 8 * 1024 * 1024 and max(sizes.values()) <= 16 * 1024 * 1024, sizes
    r = json.loads((DEMO_MODEL_DIR / "results.json").read_text())
    card = (DEMO_MODEL_DIR / "README.md").read_text()
    assert f"**{r['heldout_perplexity']}**" in card
    assert f"**{r['ast_parse_passed']}/{r['ast_parse_cases']}**" in card
    assert "PSF-2.0" in card  # the data's license
    cfg = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert cfg["text_config"]["num_nextn_predict_layers"] == 1  # the MTP drafter layer
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"  # MXFP4 experts


@pytest.fixture(scope="module")
def llm():
    from k3serve.workers.llm import LLM

    return LLM(str(DEMO_MODEL_DIR), dtype="float32", max_model_len=1024)


def test_chat_request_gets_content_and_finishes_with_stop(llm):
    from k3serve.chat.parsers import parse_output
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.model.train.acceptance import WRITE

    out = llm.chat(WRITE, SamplingParams(max_tokens=128, temperature=0.0))[0].outputs[0]
    p = parse_output(out.text, thinking=True, tools_enabled=False)
    assert out.finish_reason == "stop", out.text
    assert (p.content or "").strip(), out.text
    assert (p.reasoning or "").strip() and "<|" not in p.content  # thinking separated from the answer
    assert "def " in p.content
