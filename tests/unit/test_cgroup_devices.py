"""NVIDIA device policy, /proc/devices, and the v1 rule planner checked against a model of
the kernel's device cgroup (security/device_cgroup.c): the rules only ever take access away,
take exactly the forbidden NVIDIA devices, and leave everything else as the runtime set it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.platform.cgroups.devicepolicy import (
    DevicePolicy,
    GuardError,
    NvidiaMajors,
    parse_proc_devices,
)
from agent.platform.cgroups.devices_v1 import ALLOW_ALL, DeviceRule, parse_devices_list, plan
from agent.platform.cgroups.devices_v2 import ProgramLimits, dump_source, gpu_minor_words

PROC_DEVICES = """\
Character devices:
  1 mem
  5 /dev/tty
136 pts
195 nvidia-frontend
195 nvidia
235 nvidia-caps-imex-channels
236 nvidia-caps
507 nvidia-nvlink
508 nvidia-nvswitch
510 nvidia-uvm

Block devices:
  7 loop
200 nvidia-not-a-char-device
"""
MAJORS = NvidiaMajors(
    uvm=frozenset({510}), caps=frozenset({235, 236}), other=frozenset({507, 508}), mig_caps=frozenset({236})
)


def test_parse_proc_devices() -> None:
    assert parse_proc_devices(PROC_DEVICES) == MAJORS
    assert parse_proc_devices("Character devices:\n  1 mem\n\nBlock devices:\n") == NvidiaMajors()


def test_policy_semantics() -> None:
    gpu1 = DevicePolicy(frozenset({1}))
    assert gpu1.allows(195, 1, MAJORS) and gpu1.allows(195, 255, MAJORS)
    assert not gpu1.allows(195, 0, MAJORS) and not gpu1.allows(195, 254, MAJORS)
    assert gpu1.allows(510, 0, MAJORS) and gpu1.allows(510, 1, MAJORS)  # uvm, uvm-tools
    assert not gpu1.allows(236, 1, MAJORS) and not gpu1.allows(235, 0, MAJORS)
    assert gpu1.allows(507, 0, MAJORS)  # nvlink: not ours to take from a GPU container
    assert gpu1.allows(1, 3, MAJORS)  # /dev/null
    none = DevicePolicy(None)
    assert not any(none.allows(195, m, MAJORS) for m in range(256))
    assert not any(none.allows(major, 0, MAJORS) for major in (510, 236, 235, 507, 508))
    assert none.allows(136, 4, MAJORS)
    assert none.describe() == "no NVIDIA devices"
    assert DevicePolicy(frozenset({3, 0})).describe() == "/dev/nvidia0,/dev/nvidia3 + nvidiactl + uvm only"
    with pytest.raises(ValueError, match=r"0\.\.247"):
        DevicePolicy(frozenset({248}))


def test_parse_devices_list() -> None:
    text = "c 1:3 rwm\nc *:* m\nb *:* m\nc 195:* rw\n"
    assert parse_devices_list(text) == [
        DeviceRule("c", 1, 3, "rwm"),
        DeviceRule("c", None, None, "m"),
        DeviceRule("b", None, None, "m"),
        DeviceRule("c", 195, None, "rw"),
    ]
    assert parse_devices_list("a *:* rwm\n") == [ALLOW_ALL]
    assert [r.line() for r in parse_devices_list(text)] == text.splitlines()


@dataclass
class KernelModel:
    """A device cgroup as security/device_cgroup.c keeps it: a behavior and exceptions."""

    default_allow: bool
    exceptions: list[DeviceRule] = field(default_factory=list)

    @classmethod
    def from_list(cls, rules: list[DeviceRule]) -> KernelModel:
        if ALLOW_ALL in rules:
            return cls(True, [])
        return cls(False, list(rules))

    def _add(self, rule: DeviceRule) -> None:
        for i, ex in enumerate(self.exceptions):
            if (ex.kind, ex.major, ex.minor) == (rule.kind, rule.major, rule.minor):
                merged = "".join(c for c in "rwm" if c in ex.access or c in rule.access)
                self.exceptions[i] = DeviceRule(ex.kind, ex.major, ex.minor, merged)
                return
        self.exceptions.append(rule)

    def _remove(self, rule: DeviceRule) -> None:  # exact match only, access bits cleared
        for i, ex in enumerate(self.exceptions):
            if (ex.kind, ex.major, ex.minor) == (rule.kind, rule.major, rule.minor):
                left = "".join(c for c in ex.access if c not in rule.access)
                if left:
                    self.exceptions[i] = DeviceRule(ex.kind, ex.major, ex.minor, left)
                else:
                    del self.exceptions[i]
                return

    def write_allow(self, rule: DeviceRule) -> None:
        (self._remove if self.default_allow else self._add)(rule)

    def write_deny(self, rule: DeviceRule) -> None:
        (self._add if self.default_allow else self._remove)(rule)

    def listing(self) -> list[DeviceRule]:
        return [ALLOW_ALL] if self.default_allow else list(self.exceptions)

    def permits(self, major: int, minor: int, access: str) -> bool:
        matched = any(
            ex.kind in ("c", "a")
            and ex.major in (None, major)
            and ex.minor in (None, minor)
            and access in ex.access
            for ex in self.exceptions
        )
        return not matched if self.default_allow else matched


RUNC_DEFAULTS = [
    "c *:* m",
    "b *:* m",
    "c 1:3 rwm",
    "c 1:5 rwm",
    "c 1:9 rwm",
    "c 5:0 rwm",
    "c 136:* rwm",
    "c 10:200 rwm",
]
WHITELISTS = {
    "allow-all (privileged)": ["a *:* rwm"],
    "nvidia runtime, GPUs 0 and 1": [
        *RUNC_DEFAULTS,
        "c 195:0 rw",
        "c 195:1 rw",
        "c 195:255 rw",
        "c 510:0 rw",
        "c 510:1 rw",
        "c 236:1 r",
    ],
    "wildcard 195": [*RUNC_DEFAULTS, "c 195:* rwm", "c 510:* rwm", "c 236:* r"],
    "wildcard and specific": [*RUNC_DEFAULTS, "c 195:* rw", "c 195:1 rw", "c 195:3 rwm", "c 507:0 rw"],
    "no nvidia devices": RUNC_DEFAULTS,
}
POLICIES = {
    "gpu 1": DevicePolicy(frozenset({1})),
    "gpus 0,3": DevicePolicy(frozenset({0, 3})),
    "no gpu": DevicePolicy(None),
}
DEVICES = [(195, m) for m in range(256)] + [
    (major, minor) for major in (510, 236, 235, 507, 1, 136, 10) for minor in (0, 1, 3, 5, 200)
]


@pytest.mark.parametrize(
    ("whitelist", "policy"),
    list(itertools.product(WHITELISTS, POLICIES)),
    ids=[f"{w}-{p}" for w, p in itertools.product(WHITELISTS, POLICIES)],
)
def test_v1_plan_takes_exactly_the_forbidden_devices(whitelist: str, policy: str) -> None:
    rules = parse_devices_list("\n".join(WHITELISTS[whitelist]))
    pol = POLICIES[policy]
    kernel = KernelModel.from_list(rules)
    before = {(d, a): kernel.permits(*d, a) for d in DEVICES for a in "rwm"}

    result = plan(kernel.listing(), pol, MAJORS)
    assert not result.problems
    for rule in result.allow:
        kernel.write_allow(rule)
    for rule in result.deny:
        kernel.write_deny(rule)

    for (device, access), was in before.items():
        now = kernel.permits(*device, access)
        assert not (now and not was), f"{device} {access}: granted, was not"
        if access in "rw" or result.default_allow:
            assert now == (was and pol.allows(*device, MAJORS)), f"{device} {access}: {was} → {now}"
    if not result.default_allow:
        assert plan(kernel.listing(), pol, MAJORS).empty  # verifiable, so the next pass is quiet


def test_v1_plan_in_default_allow_mode_denies_per_minor() -> None:
    result = plan([ALLOW_ALL], DevicePolicy(frozenset({1})), MAJORS)
    assert result.default_allow
    lines = [r.line() for r in result.deny]
    assert "c 195:* rwm" not in lines  # it would take the allowed GPU too
    assert "c 195:0 rwm" in lines and "c 195:254 rwm" in lines
    assert "c 195:1 rwm" not in lines and "c 195:255 rwm" not in lines
    assert {"c 235:* rwm", "c 236:* rwm"} <= set(lines)
    assert len(lines) == 254 + 2
    no_gpu = plan([ALLOW_ALL], DevicePolicy(None), MAJORS)
    assert [r.line() for r in no_gpu.deny] == [f"c {m}:* rwm" for m in (195, 235, 236, 507, 508, 510)]


def test_v1_plan_for_a_pod_cgroup_keeps_mknod() -> None:
    # The gate's deny lines on a pod's cgroup: children inherit them, and the kernel refuses a
    # child's allow line that a parent's exception partly matches (runc's "c *:* m" too).
    result = plan([ALLOW_ALL], DevicePolicy(frozenset({1})), MAJORS, deny_access="rw")
    lines = [r.line() for r in result.deny]
    assert "c 195:0 rw" in lines and "c 195:1 rw" not in lines
    assert all(not line.endswith("m") for line in lines)
    no_gpu = plan([ALLOW_ALL], DevicePolicy(None), MAJORS, deny_access="rw")
    assert [r.line() for r in no_gpu.deny] == [f"c {m}:* rw" for m in (195, 235, 236, 507, 508, 510)]


def test_v1_plan_reports_what_it_cannot_narrow() -> None:
    rules = parse_devices_list("c *:* rwm\nc 1:3 rwm\n")
    result = plan(rules, DevicePolicy(None), MAJORS)
    assert result.problems and "grants every character device" in result.problems[0]


def test_gpu_minor_bitmap() -> None:
    assert gpu_minor_words(frozenset()) == [0, 0, 0, 0]
    assert gpu_minor_words(frozenset({0, 1, 63, 64, 200, 247})) == [
        (1 << 0) | (1 << 1) | (1 << 63),
        1 << 0,
        0,
        (1 << (200 - 192)) | (1 << (247 - 192)),
    ]


def test_device_program_source() -> None:
    text = dump_source(limits=ProgramLimits(policies=123, depth=9))
    assert text.splitlines()[1:3] == ["#define VCUDA_MAX_POLICIES 123", "#define VCUDA_MAX_DEPTH 9"]
    assert "int vcuda_devguard(struct bpf_cgroup_dev_ctx *ctx)" in text
    with pytest.raises(GuardError, match="bpf/ directory must be installed"):
        dump_source(Path("/nonexistent/device_guard.c"))
