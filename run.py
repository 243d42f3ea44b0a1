"""roll_ds entry point: compose -> validate -> connect Ray -> run the pipeline.

    python run.py --config-name rlvr_lora_zero3
    python run.py --config-name rlvr_lora_zero3 --cfg job --resolve   # print the composed config
    # switch the ZeRO stage (quoted so the shell leaves ${...} alone):
    python run.py --config-name rlvr_lora_zero3 \
        actor_train.strategy_args.strategy_config='${deepspeed_zero2}'

When Hydra rejects an override (a misspelled key, a key inside an interpolated strategy_config),
a roll_ds hint follows its message (``roll_ds/config/hints.py``). A section that is null in the
config (``reference``, ``rewards.<name>.judge``, ...) is set whole on the command line
(``'rewards.math.judge={template: ...}'``); a key inside it is refused, saying so
(``roll_ds/config/null_sections.py``).

A config in your own directory derives from the examples by name (they are on Hydra's search
path, ``hydra_plugins/roll_ds_searchpath``); its ``replace:`` section replaces inherited values
instead of merging into them (``roll_ds/config/replace.py``):

    python run.py --config-dir ~/my_configs --config-name mine
"""

from __future__ import annotations

import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import roll_ds.config.store  # noqa: F401  (registers the typed schema with Hydra)
from roll_ds import timeline
from roll_ds.config import ConfigError, to_schema, validate
from roll_ds.config.hints import hint_for_run
from roll_ds.config.null_sections import guard_overrides
from roll_ds.config.paths import launch_dir_importable
from roll_ds.config.replace import apply_replacements

guard_overrides()  # an override into a null section: set whole, or an error naming it
_IMPORTED = time.time()  # the start-up profile's first phase ends here (roll_ds/timeline.py)


@hydra.main(config_path="examples/qwen_rlvr", config_name=None, version_base="1.3")
def main(raw: DictConfig) -> None:
    timeline.record("python + imports", timeline.process_started(), _IMPORTED)
    timeline.record("compose", _IMPORTED, time.time())
    try:
        with timeline.phase("validate"):
            cfg = to_schema(apply_replacements(raw, HydraConfig.get().overrides.task))
            validate(cfg)
    except ConfigError as exc:
        print(f"roll_ds: {exc}", file=sys.stderr)
        sys.exit(2)

    from roll_ds.checkpoint import CheckpointError
    from roll_ds.pipeline.launch import run_pipeline

    try:
        run_pipeline(cfg)
    except (CheckpointError, ConfigError) as exc:  # a checkpoint that does not load (not
        # retried), or a problem found once Ray is connected (device: auto of a joined cluster)
        print(f"roll_ds: {exc}", file=sys.stderr)
        sys.exit(2)


def cli() -> None:
    """``main``, with roll_ds's hint printed under Hydra's message when Hydra rejects the config.
    Hydra prints the error and exits 1 while handling it, so the error is the exit's context."""
    launch_dir_importable()  # a config's module:Class of the user's own (config/paths.py)
    try:
        main()
    except SystemExit as exit_:
        hint = hint_for_run(exit_.__context__, sys.argv[1:]) if exit_.code == 1 else None
        if hint:
            print(f"roll_ds hint: {hint}", file=sys.stderr)
        raise


if __name__ == "__main__":
    cli()
