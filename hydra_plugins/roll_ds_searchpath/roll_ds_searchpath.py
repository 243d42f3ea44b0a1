"""Put roll_ds's example configs on every Hydra app's search path.

Hydra finds this plugin in the ``hydra_plugins`` namespace package, so a config in the user's
own directory (``python run.py --config-dir DIR --config-name mine``, or ``compose_config(...,
config_dir=DIR)``) can derive from ``rlvr_lora_zero3`` and the other examples by name, and
reaches the DeepSpeed presets the way the examples do (``- ../config/deepspeed_zero3@_here_``
resolves against ``examples/qwen_rlvr``). The files stay in ``examples/`` where users read them;
they are found next to the installed package, as in the editable install ``scripts/setup.sh``
makes. Appended last: the user's own directory and ``run.py``'s come first and can shadow an
example by its name.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "roll_ds"
# hydra_plugins/roll_ds_searchpath/ sits at the project root, beside roll_ds/ and examples/.
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "qwen_rlvr"


class RollDsSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if EXAMPLES.is_dir() and not any(_is_examples(e.path) for e in search_path.get_path()):
            search_path.append(provider=PROVIDER, path=f"file://{EXAMPLES}")


def _is_examples(path: str) -> bool:
    """Whether a search-path entry already is the examples directory (run.py's own)."""
    scheme, sep, rest = path.partition("://")
    local = rest if sep else path
    return (not sep or scheme == "file") and Path(local).resolve() == EXAMPLES
