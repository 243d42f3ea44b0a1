"""Print the GPU image's requirements, read from pyproject.toml (so no pin is written twice).

    python cluster/image_requirements.py > /tmp/requirements.txt     # run by cluster/Dockerfile

One line per requirement: the project's dependencies and its ``gpu`` extra (vLLM, which brings
the CUDA torch it pins), with two changes for the image:

- Ray gets its ``default`` extra at the same pin: the dashboard and agent that KubeRay's
  readiness probes query and that ``ray up``'s autoscaler needs on the head.
- packages that compile against torch at install time (flash-attn) are left out; the
  Dockerfile installs them afterwards with ``--no-build-isolation``, against that torch.

Standard library only (the image runs it before anything is installed).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
BUILT_AGAINST_TORCH = ("flash-attn",)  # installed after torch, without build isolation
RAY_EXTRA = "default"


def name_of(requirement: str) -> str:
    """Normalised distribution name of a requirement ('Flash_Attn>=2' -> 'flash-attn')."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def image_requirements(pyproject: dict, extra: str = "gpu") -> list[str]:
    project = pyproject["project"]
    lines = []
    for requirement in [*project["dependencies"], *project["optional-dependencies"][extra]]:
        name = name_of(requirement)
        if name in BUILT_AGAINST_TORCH:
            continue
        if name == "ray" and "[" not in requirement:
            requirement = requirement.replace("ray", f"ray[{RAY_EXTRA}]", 1)
        lines.append(requirement)
    return lines


def main() -> None:
    with open(sys.argv[1] if len(sys.argv) > 1 else PYPROJECT, "rb") as f:
        print("\n".join(image_requirements(tomllib.load(f))))


if __name__ == "__main__":
    main()
