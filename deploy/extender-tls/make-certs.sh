#!/usr/bin/env bash
# Certificates for the scheduler extender's HTTPS (docs/security.md, "The extender"):
# a CA of its own (not the cluster CA: that one also signs kubelets and users), a server
# certificate for the extender's Service and a client certificate for kube-scheduler.
#
#   deploy/extender-tls/make-certs.sh OUTDIR [EXTRA_SAN...]   # writes the PEM files
#   deploy/extender-tls/make-certs.sh --apply OUTDIR [...]    # and creates both Secrets
#
# EXTRA_SAN: DNS names or IP addresses kube-scheduler uses in urlPrefix besides the Service
# name (e.g. the Service's ClusterIP for a scheduler on the host network). Certificates are
# valid 825 days; run again (a new OUTDIR) and re-apply to rotate. Needs openssl.
set -euo pipefail

apply=0
if [ "${1:-}" = "--apply" ]; then apply=1; shift; fi
[ $# -ge 1 ] || { echo "usage: $0 [--apply] OUTDIR [EXTRA_SAN...]" >&2; exit 2; }
out=$1; shift
command -v openssl >/dev/null || { echo "make-certs: openssl is not installed" >&2; exit 1; }
mkdir -p "$out"
umask 077
days=825
service=vcuda-extender.kube-system.svc

sans="DNS:$service,DNS:$service.cluster.local,DNS:vcuda-extender"
for extra in "$@"; do
  if [[ $extra =~ ^[0-9.]+$ || $extra == *:* ]]; then sans+=",IP:$extra"; else sans+=",DNS:$extra"; fi
done

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -subj "/CN=vcuda-extender-ca" -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null

# $1 name, $2 subject CN, $3 extensions
issue() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$2" \
    -keyout "$out/$1.key" -out "$out/$1.csr" 2>/dev/null
  openssl x509 -req -in "$out/$1.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -CAcreateserial \
    -days "$days" -extfile <(printf '%s\n' "$3") -out "$out/$1.crt" 2>/dev/null
  rm -f "$out/$1.csr"
}
issue server vcuda-extender "subjectAltName=$sans
extendedKeyUsage=serverAuth
keyUsage=digitalSignature"
issue client vcuda-scheduler "extendedKeyUsage=clientAuth
keyUsage=digitalSignature"
rm -f "$out/ca.srl"
echo "make-certs: wrote $out/{ca,server,client}.{crt,key} (server names: $sans)"

if [ "$apply" -eq 1 ]; then
  # The extender: its certificate and the CA its clients' certificates must chain to.
  kubectl -n kube-system create secret generic vcuda-extender-tls \
    --from-file=tls.crt="$out/server.crt" --from-file=tls.key="$out/server.key" \
    --from-file=ca.crt="$out/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
  # kube-scheduler: its client certificate and the CA that signed the extender's.
  kubectl -n kube-system create secret generic vcuda-extender-client \
    --from-file=tls.crt="$out/client.crt" --from-file=tls.key="$out/client.key" \
    --from-file=ca.crt="$out/ca.crt" --dry-run=client -o yaml | kubectl apply -f -
fi
