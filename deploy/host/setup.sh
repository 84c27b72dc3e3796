#!/usr/bin/env bash
# Host set-up for running vcuda-agent from source on Debian/Ubuntu, as root:
# Debian packages (python3-venv, python3-bpfcc), kernel headers for bcc, tracefs, and the
# container tools the tests use (containerd, runc, crun; podman and debootstrap for the image).
# Idempotent and quick when everything is already there.
set -euo pipefail

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (apt-get, /lib/modules and tracefs need it)"
command -v apt-get >/dev/null || die "this script needs apt-get (Debian or Ubuntu)"

missing_packages() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

apt_updated=0
apt_install() {
  [ "$#" -gt 0 ] || return 0
  if [ "$apt_updated" -eq 0 ]; then
    say "apt-get update"
    apt-get update -qq
    apt_updated=1
  fi
  say "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. Python with venv, and bcc from the distribution (never the unrelated PyPI package "bcc").
# shellcheck disable=SC2046
apt_install $(missing_packages python3 python3-venv python3-bpfcc)
/usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "/usr/bin/python3 is $(/usr/bin/python3 -V 2>&1); vcuda-agent needs Python >= 3.11 (Debian 12, Ubuntu 24.04)"

# 2. Kernel headers for bcc: the exact version if the archive has it, else the nearest ones.
kver=$(uname -r)
build=/lib/modules/$kver/build
if [ -e "$build/include/linux/kconfig.h" ] || [ -e "$build/include/generated/autoconf.h" ]; then
  say "kernel headers for $kver: $(readlink -f "$build")"
else
  if apt-cache show "linux-headers-$kver" >/dev/null 2>&1; then
    apt_install "linux-headers-$kver"
  fi
  if [ ! -e "$build/include" ]; then
    arch=$(dpkg --print-architecture)
    if grep -qi ubuntu /etc/os-release; then meta=linux-headers-generic; flavour=generic; else meta=linux-headers-$arch; flavour=$arch; fi
    # shellcheck disable=SC2046
    apt_install $(missing_packages "$meta")
    nearest=$(ls -d /usr/src/linux-headers-*-"$flavour" 2>/dev/null | sort -V | tail -n 1)
    [ -n "$nearest" ] || die "no kernel headers found under /usr/src after installing $meta"
    common=${nearest%-"$flavour"}-common
    [ -d "$common" ] || common=$nearest
    mkdir -p "/lib/modules/$kver"
    ln -sfn "$nearest" "$build"
    ln -sfn "$common" "/lib/modules/$kver/source"
    say "NOTE: no headers packaged for kernel $kver; linked the nearest Debian headers $(basename "$nearest") as $build (bcc compiles tracepoint and cgroup-device programs against them)"
  fi
fi

# 3. tracefs, where bcc attaches tracepoints.
if [ ! -d /sys/kernel/tracing/events ]; then
  mkdir -p /sys/kernel/tracing 2>/dev/null || true
  if mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null; then
    say "mounted tracefs at /sys/kernel/tracing"
  else
    say "warning: could not mount tracefs at /sys/kernel/tracing; BPF tracepoints will be unavailable"
  fi
fi
# 4. Prometheus, which the dashboard test runs on loopback against the demo's agent. The
# package would enable a system service on :9090; the test starts its own instance instead.
if [ -n "$(missing_packages prometheus)" ]; then
  apt_install prometheus
  systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
# 5. Container runtimes for the real-runtime test tier (tests/runtime: a private containerd in
# a temp dir, runc/crun, an image built from busybox-static). A freshly installed package
# would start the system containerd: stop it; one that was already installed is left alone.
runtimes=$(missing_packages containerd runc crun busybox-static | tr "\n" " ")
if [ -n "$runtimes" ]; then
  # shellcheck disable=SC2086
  apt_install $runtimes
  case " $runtimes " in *" containerd "*) systemctl disable --now containerd >/dev/null 2>&1 || true ;; esac
  say "installed for tests/runtime: $runtimes"
fi
# 6. The image build and run (`make image`, tests/integration/test_image_run.py): podman
# builds the Dockerfile on a base made with debootstrap and runs it with runc (section 5).
# No service is started: podman has no daemon, and nothing is configured system-wide.
# shellcheck disable=SC2046
apt_install $(missing_packages podman debootstrap)
say "host ready"
