"""Model resolution: a local HF directory, or the embedded tiny Qwen2 built on first use.

Importing this package is light (no torch / transformers); they load when a model is built.
"""

from roll_ds.models.embedded import EMBEDDED_MODEL, resolve_pretrain

__all__ = ["EMBEDDED_MODEL", "resolve_pretrain"]
