#!/usr/bin/env bash
# `make image`: build the Dockerfile with podman, without Docker Hub.
#
# The Dockerfile's base (ARG BASE_IMAGE=debian:<suite>-slim) is made here with debootstrap
# (--variant=minbase, the same suite, trimmed like the slim image: no docs, man pages or
# locales) and imported into podman's storage as docker.io/library/debian:<suite>-slim, so
# the FROM line resolves locally with no change and nothing is pulled. The base is cached
# as a tarball (VCUDA_IMAGE_CACHE, default /var/cache/vcuda-agent) and re-imported only when
# podman's storage lacks it. Debian packages and PyPI are still fetched by the build.
#
#   deploy/image/build.sh [--no-cache] [--base-only]
#
# --no-cache: no layer cache (the base stays cached). Prints the build time and the image
# size; IMAGE and DOCKERFILE override the tag and the file. The last line is `image: TAG size_mb=... build_s=... base_mb=...`.
set -euo pipefail
cd "$(dirname "$0")/../.."

say() { echo "image: $*"; }
die() { echo "image: error: $*" >&2; exit 1; }

IMAGE=${IMAGE:-ghcr.io/vcuda-agent/vcuda-agent:0.1.0}
DOCKERFILE=${DOCKERFILE:-Dockerfile}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${VCUDA_IMAGE_CACHE:-/var/cache/vcuda-agent}
no_cache=() base_only=0
for arg in "$@"; do
  case $arg in
    --no-cache) no_cache=(--no-cache) ;;
    --base-only) base_only=1 ;;
    *) die "unknown argument $arg (usage: $0 [--no-cache] [--base-only])" ;;
  esac
done

[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap, and podman's root storage that the test runs from)"
for tool in podman debootstrap; do
  command -v "$tool" >/dev/null || die "$tool is not installed (make host / deploy/host/setup.sh installs it)"
done

base=$(sed -n 's/^ARG BASE_IMAGE=//p' "$DOCKERFILE")
suite=$(sed -n 's/^debian:\([a-z]*\)-slim$/\1/p' <<<"$base")
[ -n "$suite" ] || die "the Dockerfile's base is '$base', not debian:<suite>-slim: nothing to stand in for"
base_tag=docker.io/library/$base
base_tar=$CACHE/base-$suite.tar

# No systemd as PID 1 on every host: cgroupfs and a file events log always work.
pm() { podman --cgroup-manager=cgroupfs --events-backend=file "$@"; }

# The slim variant's dpkg excludes and apt settings (as Debian's official images have them).
trim_root() {
  local root=$1
  mkdir -p "$root/etc/dpkg/dpkg.cfg.d" "$root/etc/apt/apt.conf.d"
  cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# The slim variant: files a container does not need are not installed.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
EOF
  cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
  echo 'Acquire::GzipIndexes "true";' >"$root/etc/apt/apt.conf.d/docker-gzip-indexes"
  echo 'Apt::AutoRemove::SuggestsImportant "false";' >"$root/etc/apt/apt.conf.d/docker-autoremove-suggests"
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $suite $suite-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: $suite-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$root"/usr/share/{groff,info,linda,lintian,locale,man}/* \
    "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/*.log \
    "$root"/var/log/apt/* "$root"/var/cache/ldconfig/aux-cache \
    "$root"/etc/resolv.conf "$root"/etc/hostname "$root"/etc/hosts
}

make_base_tar() {
  local root
  mkdir -p "$CACHE"
  root=$(mktemp -d "$CACHE/root.XXXXXX")
  # shellcheck disable=SC2064
  trap "rm -rf '$root'" EXIT
  say "debootstrap --variant=minbase $suite from $MIRROR (once; cached as $base_tar)"
  debootstrap --variant=minbase "$suite" "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -n 20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
  trim_root "$root"
  tar --numeric-owner --xattrs -C "$root" --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* \
    --exclude=./run/* --exclude=./tmp/* -cf "$base_tar.tmp" .
  sha256sum "$base_tar.tmp" | cut -d' ' -f1 >"$base_tar.sha256"
  mv "$base_tar.tmp" "$base_tar"
  rm -rf "$root"
  trap - EXIT
}

# One base build at a time (the test session and a benchmark may start together).
mkdir -p "$CACHE"
exec 9>"$CACHE/lock"
flock 9
start=$(date +%s.%N)
[ -s "$base_tar" ] && [ -s "$base_tar.sha256" ] || make_base_tar
sha=$(cat "$base_tar.sha256")
have=$(pm image inspect --format '{{index .Config.Labels "io.vcuda.base.sha256"}}' "$base_tag" 2>/dev/null || true)
if [ "$have" != "$sha" ]; then
  say "importing $base_tar as $base_tag: a debootstrap stand-in for Docker Hub's image (same suite)"
  pm import -q --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change "LABEL io.vcuda.base.sha256=$sha io.vcuda.base.origin=debootstrap" \
    --message "debootstrap --variant=minbase $suite (stand-in for $base)" "$base_tar" "$base_tag" >/dev/null
else
  say "$base_tag is the cached debootstrap stand-in for Docker Hub's image"
fi
flock -u 9
base_mb=$(pm image inspect --format '{{.Size}}' "$base_tag" | awk '{printf "%.1f", $1 / 1e6}')
[ "$base_only" -eq 0 ] || { say "base $base_tag size_mb=$base_mb"; exit 0; }

revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
version=${IMAGE##*:}
# Where egress goes through a TLS-inspecting proxy, the host trusts its CA and the build
# must too: the host's bundle (PIP_CERT, else SSL_CERT_FILE) and a pip.conf naming it are
# mounted into the RUN steps only; neither ends up in a layer.
build_mounts=()
ca=${PIP_CERT:-${SSL_CERT_FILE:-}}
if [ -n "$ca" ] && [ -s "$ca" ]; then
  pipconf=$(mktemp "$CACHE/pip.conf.XXXXXX")
  trap 'rm -f "$pipconf"' EXIT
  printf '[global]\ncert = /etc/ssl/certs/vcuda-build-ca.crt\n' >"$pipconf"
  chmod 644 "$pipconf"
  build_mounts=(-v "$(readlink -f "$ca"):/etc/ssl/certs/vcuda-build-ca.crt:ro" -v "$pipconf:/etc/pip.conf:ro")
  say "pip in the build trusts the host's CA bundle $ca (mounted, not copied)"
fi
build_start=$(date +%s.%N)
# chroot isolation: no OCI runtime for the RUN steps (crun 1.8 refuses hybrid cgroup hosts).
pm build --pull=never --network=host --isolation=chroot --layers "${no_cache[@]}" "${build_mounts[@]}" \
  --build-arg "VERSION=$version" --build-arg "REVISION=$revision" -t "$IMAGE" -f "$DOCKERFILE" .
end=$(date +%s.%N)
size_mb=$(pm image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.1f", $1 / 1e6}')
build_s=$(awk -v a="$build_start" -v b="$end" 'BEGIN {printf "%.1f", b - a}')
total_s=$(awk -v a="$start" -v b="$end" 'BEGIN {printf "%.1f", b - a}')
say "$IMAGE size_mb=$size_mb build_s=$build_s total_s=$total_s base_mb=$base_mb"
