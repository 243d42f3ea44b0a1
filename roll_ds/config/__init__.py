"""Typed configuration: schemas, ConfigStore registration, DeepSpeed config building, validation.

Importable without torch, Ray, DeepSpeed or vLLM.
"""

from roll_ds.config.compose import compose_config, load_config
from roll_ds.config.deepspeed import DeepSpeedInputs, build_deepspeed_config
from roll_ds.config.device_mapping import parse_device_mapping
from roll_ds.config.schema import EMBEDDED_MODEL, RLVRConfig, WorkerConfig
from roll_ds.config.validate import ConfigError, to_schema, validate

__all__ = [
    "EMBEDDED_MODEL",
    "ConfigError",
    "DeepSpeedInputs",
    "RLVRConfig",
    "WorkerConfig",
    "build_deepspeed_config",
    "compose_config",
    "load_config",
    "parse_device_mapping",
    "to_schema",
    "validate",
]
