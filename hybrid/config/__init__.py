"""Configuration: the model's config.json (model_config.py), the engine's limits (engine_config.py), $HYBRIDD_HOME."""

from hybrid.config.engine_config import EngineConfig
from hybrid.config.model_config import ConfigError, ModelConfig, RopeConfig

__all__ = ["ConfigError", "EngineConfig", "ModelConfig", "RopeConfig"]
