"""The sandbox's syscall filter: a seccomp BPF program, built with libseccomp (``pyseccomp``)
and handed to bubblewrap (``bwrap --seccomp FD``), which loads it right before it execs the
program.

Allow by default, refuse (``EPERM``) what a scoring program never needs: debugging other
processes, mounts and namespaces (an escape's first steps), the kernel keyring, eBPF,
performance counters, raw and packet sockets, io_uring, loading kernels or modules and the
host-wide clocks and switches. ``clone`` with a namespace flag is refused like ``unshare``;
``clone3`` (whose flags sit in memory a filter cannot read) answers ``ENOSYS``, so the C library
falls back to ``clone``. A foreign architecture's syscalls (e.g. 32-bit ``int 0x80`` on x86_64)
kill the process (libseccomp's default for an architecture the filter does not name).
"""

from __future__ import annotations

import errno
import tempfile

#: syscalls refused outright (names unknown to this libseccomp / architecture are skipped)
DENIED = (
    # other processes and the kernel's internals
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # keys
    "keyctl",
    "add_key",
    "request_key",
    # mounts, roots and namespaces
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    # kernels, modules and host-wide state
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "sethostname",
    "setdomainname",
    "iopl",
    "ioperm",
    "personality",
    "uselib",
    "vhangup",
)
#: clone(2) flags that make a namespace (sched.h)
CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
AF_PACKET, SOCK_RAW, SOCK_TYPE_MASK = 17, 3, 0xF


class SeccompUnavailable(RuntimeError):
    """libseccomp (``pyseccomp`` over ``libseccomp2``) cannot build the filter here."""


def build_filter() -> bytes:
    """The filter as a raw BPF program (what ``bwrap --seccomp`` reads)."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # OSError: libseccomp.so.2 missing
        raise SeccompUnavailable(
            f"cannot load libseccomp ({type(e).__name__}: {e}): install the Python package "
            "pyseccomp (a dependency of roll_ds) and the system library libseccomp2"
        ) from e
    f = sc.SyscallFilter(sc.ALLOW)
    refuse = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            f.add_rule(refuse, name)
        except (OSError, ValueError, RuntimeError):  # not a syscall of this architecture
            continue
    for flag in CLONE_NEW.values():
        f.add_rule(refuse, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.add_rule(refuse, "socket", sc.Arg(0, sc.EQ, AF_PACKET))
    f.add_rule(refuse, "socket", sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, SOCK_RAW))
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()
