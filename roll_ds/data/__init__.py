"""Task data: jsonl loading and validation, sources, row mapping, prompts, sampling.

Importing this package is light (no torch / transformers).
"""

from roll_ds.data.dataset import DatasetFormatError, load_jsonl_rows

__all__ = ["DatasetFormatError", "load_jsonl_rows"]
