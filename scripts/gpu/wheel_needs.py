"""The requirements (Python 3.12, Linux x86-64, no extras) of the wheels in a folder that no wheel there provides: each
must already be on the GPU machine, or come from another folder of wheels. Used by make_lc_wheels.sh and
make_lmeval_wheels.sh.

    python3 scripts/gpu/wheel_needs.py DIR
"""

import re
import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "extra": "",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(folder: str) -> int:
    whls = sorted(Path(folder).glob("*.whl"))
    have = {norm(w.name.split("-")[0]) for w in whls}
    need: dict[str, set] = {}
    for w in whls:
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is not None and not req.marker.evaluate(ENV):
                    continue
                if norm(req.name) not in have:
                    need.setdefault(norm(req.name), set()).add(f"{req}  (from {w.name.split('-')[0]})")
    print("requirements the machine (or another folder of wheels) must already hold:")
    for name in sorted(need):
        print("  " + "; ".join(sorted(need[name])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
