"""Models: loading a role's HF model (``loading``), the value / reward heads, LoRA, weights, and
the embedded tiny models shipped with the package, found by name (``shipped``).

Importing this package is light (no torch / transformers); they load when a model is built.
"""
