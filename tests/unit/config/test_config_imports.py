import subprocess
import sys

HEAVY = ("torch", "ray", "deepspeed", "vllm", "transformers")


def test_config_package_imports_without_heavy_modules():
    code = (
        "import sys\n"
        "import roll_ds.config, roll_ds.config.store, roll_ds.strategy, roll_ds.platform\n"
        "from roll_ds.config import load_config\n"
        "load_config('rlvr_lora_zero3', check_files=False)\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "[]"
