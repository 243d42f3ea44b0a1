"""Models: loading a role's HF model (``loading``), the value / reward heads, LoRA, weights, and
the embedded tiny models (``embedded``, ``embedded_rm``, ``embedded_agent``) found by name through
``loading.EMBEDDED_MODELS``.

Importing this package is light (no torch / transformers); they load when a model is built.
"""
