"""The pipeline's prompt rows: read from the configured data files and tokenized.

Runs in ``RLVRPipeline.__init__``, before any Ray actor starts, so malformed rows and prompts
over ``prompt_length`` fail the start with the override that fixes them.
"""

from __future__ import annotations

import logging
from typing import Any

from roll_ds.data.prompts import prompt_token_ids
from roll_ds.data.sources import load_rows

logger = logging.getLogger(__name__)


def load_prompt_rows(data_args: Any) -> list[dict]:
    """The rows of ``data_args``' files, the first ``max_samples`` of them where set."""
    rows = load_rows(data_args)
    return rows[: data_args.max_samples] if data_args.max_samples else rows


def encode_prompts(
    tokenizer: Any, rows: list[dict], data_args: Any, where: str, prompt_length: int
) -> list[dict]:
    """Tokenize every prompt (``row["prompt_ids"]``); prompts over ``prompt_length`` fail the
    start, or are dropped (and counted in the log) with ``data_args.filter_overlong_prompts``."""
    limit = prompt_length
    for row in rows:
        row["prompt_ids"] = prompt_token_ids(tokenizer, row, data_args, where)
    too_long = [row["id"] for row in rows if len(row["prompt_ids"]) > limit]
    if not too_long:
        return rows
    if not data_args.filter_overlong_prompts:
        raise ValueError(
            f"{where}.data_args: {len(too_long)} prompt(s) exceed prompt_length={limit} "
            f"tokens (e.g. {too_long[:3]}); raise prompt_length, shorten the prompts, or set "
            f"{where}.data_args.filter_overlong_prompts=true to drop them"
        )
    kept = [row for row in rows if len(row["prompt_ids"]) <= limit]
    logger.warning(
        "%s.data_args.filter_overlong_prompts: dropped %d of %d prompts over prompt_length=%d "
        "tokens (e.g. %s)",
        where,
        len(too_long),
        len(rows),
        limit,
        too_long[:3],
    )
    if not kept:
        raise ValueError(
            f"{where}.data_args: every prompt exceeds prompt_length={limit} tokens; raise "
            "prompt_length"
        )
    return kept
