"""Where a config's relative paths and import paths resolve, wherever a run is launched from.

* A path the shipped configs name (their data files) is written ``${roll_ds_root:}/examples/...``:
  the ``roll_ds_root`` resolver is the project's root (the checkout ``pip install`` installed),
  so ``rlvr_lora_zero3`` finds its data when launched from any directory.
* A relative path you write (in your YAML or on the command line: ``file_name``, ``output_dir``,
  ``pretrain``, ``nvme_path``, ...) stays relative to the directory you launch from, as in any
  command-line tool; ``${roll_ds_root:}`` reaches the shipped files from your own configs too.
* An import path ``module:Class`` of your own (``env_type``, a reward function's ``name``)
  imports from the launch directory as well as ``PYTHONPATH``: ``run.py`` puts the launch
  directory on the driver's ``sys.path`` (``python -m`` does the same) and Ray puts it on every
  worker's.

Registered when ``roll_ds.config.store`` is imported (``run.py``, ``compose_config``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ROOT_RESOLVER = "roll_ds_root"


def register_resolvers() -> None:
    """``${roll_ds_root:}``: the project's root directory, absolute."""
    OmegaConf.register_new_resolver(ROOT_RESOLVER, lambda: str(PROJECT_ROOT), replace=True)


def launch_dir_importable() -> None:
    """Make modules in the launch directory importable in this process (appended: an installed
    package of the same name still wins)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
