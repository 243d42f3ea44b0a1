"""The code sandbox: run an untrusted Python program with stdin, get its output and a category.

Shared infrastructure below its users (the ``code`` reward, ``roll_ds/rewards/code_reward.py``,
and the agentic ``python`` tool, ``roll_ds/agentic/tools.py``); it imports nothing of roll_ds
outside this package, and only the standard library (and ``pyseccomp``, libseccomp's binding,
for its syscall filter). Programs run under bubblewrap (``bwrap``).

* :mod:`roll_ds.sandbox.run` - :class:`Sandbox` (probe the kernel once, then run programs) and
  what a program in it meets;
* :mod:`roll_ds.sandbox.limits` / :mod:`roll_ds.sandbox.result` - what a run may use
  (:class:`SandboxLimits`), what it gave (:class:`SandboxResult`) and its error category;
* :mod:`roll_ds.sandbox.launcher` - between the sandbox and the program: starts it under bwrap,
  started by file path under ``python -I -S -B`` (standard library only);
* :mod:`roll_ds.sandbox.seccomp` - the syscall filter bwrap loads before the program's exec;
* :mod:`roll_ds.sandbox.cgroup` - the per-run cgroup v2 limits where the host offers them.
"""

from roll_ds.sandbox.limits import NETWORK_ISOLATION, SandboxLimits
from roll_ds.sandbox.result import CATEGORIES, SandboxResult
from roll_ds.sandbox.run import Sandbox, SandboxUnavailable

__all__ = [
    "CATEGORIES",
    "NETWORK_ISOLATION",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
]
