"""egmla: attention that stores less. MHA/GQA, MLA and EG-MLA backbones with exact KV accounting."""

from egmla.config import (
    ATTENTION_REGISTRY,
    ConfigError,
    EGMLAConfig,
    MHAConfig,
    MLAConfig,
    ModelConfig,
)

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_REGISTRY",
    "ConfigError",
    "EGMLAConfig",
    "MHAConfig",
    "MLAConfig",
    "ModelConfig",
    "__version__",
]
