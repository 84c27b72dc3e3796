"""GPU device rules on cgroup v1: lines written to the container's devices.deny.

The kernel's semantics (security/device_cgroup.c) decide what a line does:

- default-allow cgroups (devices.list shows ``a *:* rwm``; privileged containers): a
  deny line adds an exception. ``c 195:* rwm`` would also take the allowed minors, so
  major 195 is denied minor by minor. devices.list cannot show these exceptions, so they
  cannot be verified: they are re-written on every pass (idempotent, ~1 ms for 255 lines).
- default-deny cgroups (what runc gives containers: a whitelist): a deny line only
  removes a whitelist entry that matches it exactly. So every entry granting a
  forbidden device is removed as written; a ``c 195:* ...`` wildcard is first narrowed
  to the allowed minors (allow lines with the wildcard's access, a subset of what it
  granted), then removed. devices.list shows the result, so drift is detected.
  ``c *:* m`` (runc's blanket mknod) stays: it grants no read or write.

What was written is remembered per cgroup so ``remove`` can give it back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from agent.platform.cgroups.devicepolicy import (
    NVIDIA_MAJOR,
    DevicePolicy,
    GuardError,
    NvidiaMajors,
    Outcome,
)

CONTROLLER = "devices"


@dataclass(frozen=True)
class DeviceRule:
    """One devices.list / devices.allow / devices.deny line; None is ``*``."""

    kind: str  # "a", "b" or "c"
    major: int | None
    minor: int | None
    access: str  # a subset of "rwm"

    def line(self) -> str:
        if self.kind == "a":
            return "a *:* rwm"
        major = "*" if self.major is None else str(self.major)
        minor = "*" if self.minor is None else str(self.minor)
        return f"{self.kind} {major}:{minor} {self.access}"


ALLOW_ALL = DeviceRule("a", None, None, "rwm")


def parse_devices_list(text: str) -> list[DeviceRule]:
    rules = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 3 or ":" not in fields[1]:
            continue
        major, minor = fields[1].split(":", 1)
        rules.append(
            DeviceRule(
                fields[0],
                None if major == "*" else int(major),
                None if minor == "*" else int(minor),
                fields[2],
            )
        )
    return rules


@dataclass(frozen=True)
class V1Plan:
    """The writes that make a cgroup's rules hold, in order: allow lines, then deny lines."""

    default_allow: bool
    allow: tuple[DeviceRule, ...] = ()
    deny: tuple[DeviceRule, ...] = ()
    problems: tuple[str, ...] = ()  # entries that cannot be narrowed without touching other devices

    @property
    def empty(self) -> bool:
        return not self.allow and not self.deny


def plan(
    current: list[DeviceRule], policy: DevicePolicy, majors: NvidiaMajors, deny_access: str = "rwm"
) -> V1Plan:
    """What to write, given the cgroup's devices.list (pure; see the module docstring).
    ``deny_access``: what a default-allow cgroup's deny lines take ("rw" on a pod's cgroup)."""
    denied_majors = policy.denied_majors(majors)
    # Majors handled minor by minor: 195, and nvidia-caps for a container with MIG devices.
    per_minor = {NVIDIA_MAJOR: (policy.allowed_minors(), 256)}
    per_minor.update({m: (policy.cap_minors, policy.caps_bound()) for m in policy.per_minor_caps(majors)})
    if ALLOW_ALL in current:
        deny = []
        for major, (allowed, bound) in sorted(per_minor.items()):
            if not allowed:
                deny.append(DeviceRule("c", major, None, deny_access))
            else:
                deny += [DeviceRule("c", major, m, deny_access) for m in range(bound) if m not in allowed]
        deny += [DeviceRule("c", major, None, deny_access) for major in sorted(denied_majors)]
        return V1Plan(default_allow=True, deny=tuple(deny))
    allow: list[DeviceRule] = []
    deny = []
    problems: list[str] = []
    for rule in current:
        if rule.kind != "c":
            continue
        if rule.major is None:
            if set(rule.access) & {"r", "w"}:
                problems.append(
                    f"'{rule.line()}' grants every character device; it cannot be narrowed to "
                    "the allowed NVIDIA devices without affecting the others"
                )
        elif rule.major in per_minor:
            allowed = per_minor[rule.major][0]
            if rule.minor is None:
                allow += [
                    DeviceRule("c", rule.major, m, rule.access)
                    for m in sorted(allowed)
                    if DeviceRule("c", rule.major, m, rule.access) not in current
                ]
                deny.append(rule)
            elif rule.minor not in allowed:
                deny.append(rule)
        elif rule.major in denied_majors:
            deny.append(rule)
    return V1Plan(default_allow=False, allow=tuple(allow), deny=tuple(deny), problems=tuple(problems))


@dataclass
class _Written:
    """What this process wrote to one cgroup, to give back on ``remove``."""

    inode: int
    policy: DevicePolicy
    # Insertion-ordered sets: the order they were written in is the order to give them back.
    allowed: dict[DeviceRule, None] = field(default_factory=dict)
    denied: dict[DeviceRule, None] = field(default_factory=dict)
    default_allow: bool = False


class V1DeviceRules:
    """``DeviceRules`` through the v1 devices controller."""

    controller = CONTROLLER

    def __init__(self, majors: NvidiaMajors | None = None, *, deny_access: str = "rwm") -> None:
        """``deny_access="rw"`` for a pod's cgroup (the device gate): a child inherits the
        parent's deny lines, and the kernel refuses a child any allow line that a parent's
        exception partly matches, runc's blanket ``c *:* m`` included, unless "m" stays."""
        self._majors = majors or NvidiaMajors()
        self._deny_access = deny_access
        self._written: dict[Path, _Written] = {}

    def set_majors(self, majors: NvidiaMajors) -> None:
        self._majors = majors

    def _read(self, cgroup_dir: Path) -> list[DeviceRule]:
        path = cgroup_dir / "devices.list"
        try:
            return parse_devices_list(path.read_text())
        except OSError as err:
            raise GuardError(f"cannot read {path}: {err.strerror or err}") from err

    def _write(self, cgroup_dir: Path, name: str, rules: list[DeviceRule]) -> None:
        if not rules:
            return
        path = cgroup_dir / name
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError as err:
            raise GuardError(f"cannot open {path}: {err.strerror or err}") from err
        try:
            for rule in rules:  # the kernel takes one rule per write
                try:
                    os.write(fd, rule.line().encode())
                except OSError as err:
                    raise GuardError(f"writing '{rule.line()}' to {path}: {err.strerror or err}") from err
        finally:
            os.close(fd)

    def _inode(self, cgroup_dir: Path) -> int:
        try:
            return cgroup_dir.stat().st_ino
        except OSError as err:
            raise GuardError(f"cgroup {cgroup_dir} is gone: {err.strerror or err}") from err

    def planned(self, cgroup_dir: Path, policy: DevicePolicy) -> list[str]:
        result = plan(self._read(cgroup_dir), policy, self._majors, self._deny_access)
        lines = [f"{cgroup_dir}/devices.allow <- {r.line()}" for r in result.allow]
        lines += [f"{cgroup_dir}/devices.deny <- {r.line()}" for r in result.deny]
        return lines + [f"{cgroup_dir}: {p}" for p in result.problems]

    def ensure(self, cgroup_dir: Path, policy: DevicePolicy, audit: bool) -> Outcome:
        inode = self._inode(cgroup_dir)
        state = self._written.get(cgroup_dir)
        if state is not None and state.inode == inode and state.policy != policy:
            self.remove(cgroup_dir)  # a new policy starts from what the runtime granted
            state = None
        fresh = state is None or state.inode != inode
        if audit:  # v1 cannot count accesses; the guard logs ``planned`` instead
            if fresh:
                self._written[cgroup_dir] = _Written(inode, policy)
            return Outcome.APPLIED if fresh else Outcome.UNCHANGED
        result = plan(self._read(cgroup_dir), policy, self._majors, self._deny_access)
        if state is None or fresh:
            state = self._written[cgroup_dir] = _Written(inode, policy, default_allow=result.default_allow)
        # Remembered before writing, so a write failing half-way is still given back.
        state.allowed.update(dict.fromkeys(result.allow))
        state.denied.update(dict.fromkeys(result.deny))
        self._write(cgroup_dir, "devices.allow", list(result.allow))
        self._write(cgroup_dir, "devices.deny", list(result.deny))
        if not result.default_allow:
            after = plan(self._read(cgroup_dir), policy, self._majors, self._deny_access)
            if not after.empty:
                raise GuardError(
                    f"{cgroup_dir}/devices.list still grants "
                    f"{', '.join(r.line() for r in after.deny)} after writing the deny rules"
                )
        if result.problems:
            raise GuardError(f"{cgroup_dir}: " + "; ".join(result.problems))
        if fresh:
            return Outcome.APPLIED
        # Without a whitelist the kernel hides its exceptions: re-writing is all one can do.
        return Outcome.REPAIRED if not result.empty and not result.default_allow else Outcome.UNCHANGED

    def remove(self, cgroup_dir: Path) -> None:
        state = self._written.pop(cgroup_dir, None)
        if state is None or not cgroup_dir.is_dir():
            return
        if self._inode(cgroup_dir) != state.inode:
            return  # a new cgroup under the same name: none of this is ours
        # Default-allow: an allow line removes the exception our deny line added.
        # Whitelist: allow lines put back the entries our deny lines removed.
        self._write(cgroup_dir, "devices.allow", list(state.denied))
        if not state.default_allow:
            self._write(cgroup_dir, "devices.deny", [r for r in state.allowed if r not in state.denied])

    def denied(self, cgroup_dir: Path) -> int | None:
        return None

    def close(self) -> None:
        self._written.clear()
