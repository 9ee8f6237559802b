"""The `small` preset on a CUDA GPU (run on the lent H200 only): generated on the device in seconds, loads,
and its bf16 reference forward is finite and non-degenerate; generation is deterministic per seed."""

import hashlib
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _digest(d):
    h = hashlib.sha256()
    for f in sorted(d.iterdir()):
        if f.suffix in (".safetensors", ".json", ".model"):
            h.update(f.read_bytes())
    return h.hexdigest()


def test_small_preset_on_gpu(tmp_path):
    from k3serve.tokenizer import K3Tokenizer
    from k3serve.workers.model.loader import load_model_weights
    from k3serve.workers.model.make_model import make_model
    from k3serve.workers.model.reference import ReferenceModel, greedy_generate

    t0 = time.time()
    make_model(tmp_path / "a", preset="small", seed=0)
    assert time.time() - t0 < 120  # generated on the GPU, no per-expert Python loops
    assert len(list((tmp_path / "a").glob("model-*-of-*.safetensors"))) >= 2
    assert (tmp_path / "a" / "model.safetensors.index.json").is_file()

    cfg, w = load_model_weights(tmp_path / "a", dtype=torch.bfloat16, device="cuda")
    packed = sum(t.numel() for k, t in w.items() if k.endswith("_packed"))
    dense = sum(t.numel() for k, t in w.items() if t.dtype != torch.uint8)
    assert 2e9 < dense + 2 * packed < 8e9  # a few billion parameters
    ids = K3Tokenizer.from_dir(str(tmp_path / "a")).encode("The quick brown fox jumps over the lazy dog.")
    model = ReferenceModel(cfg, w, torch.bfloat16)
    with torch.no_grad():
        logits = model.logits(ids)
    assert torch.isfinite(logits).all() and logits.std() > 0.5
    assert len(set(logits.argmax(-1).tolist())) > len(ids) // 2
    new = greedy_generate(model, ids, 8)
    assert len(set(new)) > 2  # not one repeated token

    del w, model
    torch.cuda.empty_cache()
    make_model(tmp_path / "b", preset="small", seed=0)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
