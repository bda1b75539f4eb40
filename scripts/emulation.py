"""Another machine's programs run here, under Debian's qemu-user-static: for scripts/package, which builds
the arm64 .debs and image on an amd64 machine, and for the tests that run them.

The kernel runs a foreign program through the interpreter registered for its kind with binfmt_misc.
``emulating("aarch64")`` mounts binfmt_misc if it is not, registers qemu-aarch64 from Debian's own
definition (qemu-user-static's /usr/lib/binfmt.d) if nothing is registered under that name, and on the
way out, failure or not, undoes what it did and only that: the machine is left as it was found. It says
on stderr what it does.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

BINFMT_MISC = Path("/proc/sys/fs/binfmt_misc")
# Where qemu-user-static puts its definitions, in the format binfmt_misc's register file reads.
DEFINITIONS = Path("/usr/lib/binfmt.d")

# qemu's default aarch64 CPU ("max") authenticates pointers with the architecture's QARMA algorithm, slow to
# emulate, and Debian 13 builds its arm64 programs to authenticate every return: its Python ran 5 to 7 times
# slower for it here. qemu's own, implementation-defined algorithm (the remedy its documentation gives)
# costs next to nothing.
CPU = {"aarch64": "max,pauth-impdef=on"}


class EmulationError(Exception):
    """The machine cannot run the foreign programs, and what to do about it."""


def say(text: str) -> None:
    print(f"emulation: {text}", file=sys.stderr, flush=True)


def environment(machine: str) -> dict[str, str]:
    """What a program of ``machine`` runs with, here, for qemu: to be passed on to it wherever an environment
    is made afresh (``env -i``, a container's)."""
    return {"QEMU_CPU": CPU[machine]} if machine in CPU else {}


def handler_name(machine: str) -> str:
    """The name Debian registers the interpreter of ``machine`` (the kernel's name: aarch64) under."""
    return f"qemu-{machine}"


def binfmt_misc_mounted() -> bool:
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1:3] == [str(BINFMT_MISC), "binfmt_misc"] for line in mounts)


def definition(machine: str) -> str:
    """Debian's registration of qemu for ``machine``, with the F flag: the kernel opens the interpreter when it
    is registered, so that it runs in a chroot or a container whose root has no qemu."""
    path = DEFINITIONS / f"{handler_name(machine)}.conf"
    if not path.is_file():
        raise EmulationError(f"no {path}: apt-get install qemu-user-static (scripts/bootstrap does)")
    [line] = [line for line in path.read_text().splitlines() if line.startswith(":")]
    # :name:type:offset:magic:mask:interpreter:flags; magic and mask escape any colon of theirs as \x3a.
    fields = line.split(":")
    if len(fields) != 8 or fields[1] != handler_name(machine):
        raise EmulationError(f"{path}: not a binfmt_misc registration of {handler_name(machine)}: {line!r}")
    if not Path(fields[6]).exists():
        raise EmulationError(f"{path} names {fields[6]}, which is missing: apt-get install --reinstall qemu-user-static")
    if "F" not in fields[7]:
        fields[7] += "F"
    return ":".join(fields)


def check_registered(machine: str) -> None:
    """A registration found in place is used as it is, if it can serve chroots and containers."""
    entry = BINFMT_MISC / handler_name(machine)
    status = entry.read_text().splitlines()
    flags = next((line.split(":", 1)[1].strip() for line in status if line.startswith("flags:")), "")
    if status[0] != "enabled" or "F" not in flags:
        raise EmulationError(
            f"{entry} is registered but {status[0]}, with flags {flags!r}: it would not run {machine} programs in a"
            f" chroot; left as it is. Remove it (echo -1 >{entry}) for this to register Debian's, or enable it with the F flag"
        )


@contextmanager
def emulating(*machines: str) -> Iterator[None]:
    """Within it, programs of each of ``machines`` (the kernel's names: aarch64) run here, in chroots too."""
    with ExitStack() as undo:
        for machine in machines:
            if not binfmt_misc_mounted():
                say(f"mounting binfmt_misc on {BINFMT_MISC}")
                subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT_MISC)], check=True)
                undo.callback(unmount)
            if (BINFMT_MISC / handler_name(machine)).exists():
                check_registered(machine)
                say(f"{handler_name(machine)} is registered already: used as it is")
                continue
            registration = definition(machine)
            say(f"registering {handler_name(machine)} with binfmt_misc, from {DEFINITIONS}")
            (BINFMT_MISC / "register").write_text(registration)
            undo.callback(unregister, machine)
        yield


def unregister(machine: str) -> None:
    say(f"unregistering {handler_name(machine)}, as it was not registered")
    (BINFMT_MISC / handler_name(machine)).write_text("-1")


def unmount() -> None:
    say(f"unmounting {BINFMT_MISC}, as it was not mounted")
    subprocess.run(["umount", str(BINFMT_MISC)], check=True)
