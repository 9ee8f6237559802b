"""k3serve.workers.model: the K3 / Kimi-Linear model definition, checkpoint format, loader, generator and
the plain-PyTorch reference forward pass (the oracle for the engine).

Imports only torch and safetensors (tiktoken via the tokenizer when generating a model): never the
HTTP, gRPC or kopf stacks.

Modules: config (K3Config), spec (canonical weight names/shapes), checkpoint (disk names, writing),
loader (load_model_weights), init_weights (random weights), make_model (presets, CLI), paths
(model cache, ensure_tiny_model), reference (ReferenceModel, reference_generate), functional / kda / mla
/ attn_res / moe (the layers), testing (random_config and friends).
"""

from .config import ConfigError, K3Config
from .loader import CheckpointError, load_model_weights
from .paths import ensure_tiny_model, model_cache_dir

__all__ = ["CheckpointError", "ConfigError", "K3Config", "ensure_tiny_model", "load_model_weights",
           "model_cache_dir"]
