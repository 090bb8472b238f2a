#!/usr/bin/env bash
# Writes the secrets that the kustomize base turns into the Secret rubato-job. They are gitignored:
# never commit them.
#
#   deploy/k8s/make-secret.sh [--force]
#       base/job.secret: 32 random bytes as 64 hex digits, mode 0600. Every process of a job shares
#       it (each worker's token is an HMAC under it). An existing one is kept unless --force is
#       given (a new secret gives the Secret a new name; a running job keeps the old one).
#       base/job.id: this run's job id, rubato-<UTC time>-<16 random hex digits>, written afresh
#       every time (the ConfigMap rubato-job-id). Every token is made from the secret and the job
#       id, so a job started later with the kept secret accepts nothing of an earlier one: run
#       this script before each `kubectl apply -k`.
#   deploy/k8s/make-secret.sh --tls SHARDS WORKERS [NAMESPACE]
#       also components/tls/{ca.crt,tls.crt,tls.key} for the tls component (mutual TLS): a fresh
#       CA (its key is discarded once it has signed) and one certificate for the whole job whose
#       subject alternative names are the pods' DNS names, rubato-ps-<i>.rubato-ps for i < SHARDS
#       and rubato-worker-<i>.rubato-ring for i < WORKERS (and, given NAMESPACE, the same names
#       under NAMESPACE.svc.cluster.local), valid for 30 days. Needs openssl.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"
umask 077

usage="$0 [--force] [--tls SHARDS WORKERS [NAMESPACE]]"
force=
tls=
while [ $# -gt 0 ]; do
  case "$1" in
    --force) force=1; shift ;;
    --tls)
      [ $# -ge 3 ] || { echo "make-secret: usage: $usage" >&2; exit 2; }
      tls=1 shards=$2 workers=$3 namespace=
      shift 3
      if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then namespace=$1; shift; fi
      ;;
    *) echo "make-secret: usage: $usage" >&2; exit 2 ;;
  esac
done

secret=base/job.secret
if [ -e "$secret" ] && [ -z "$force" ]; then
  echo "make-secret: $secret exists; keeping it (--force makes a new one)" >&2
else
  tmp=$(mktemp "$secret.XXXXXX")
  trap 'rm -f "$tmp"' EXIT
  od -An -N32 -tx1 /dev/urandom | tr -d ' \n' > "$tmp"
  if [ "$(wc -c < "$tmp")" -ne 64 ]; then
    echo "make-secret: could not read 32 random bytes" >&2
    exit 1
  fi
  chmod 600 "$tmp"
  mv "$tmp" "$secret"
  trap - EXIT
  echo "make-secret: wrote $(pwd)/$secret (mode 0600, gitignored)" >&2
fi

job_id="rubato-$(date -u +%Y%m%d%H%M%S)-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')"
if ! [[ "$job_id" =~ ^rubato-[0-9]{14}-[0-9a-f]{16}$ ]]; then
  echo "make-secret: could not make a job id (got '$job_id')" >&2
  exit 1
fi
printf '%s' "$job_id" > base/job.id
echo "make-secret: wrote $(pwd)/base/job.id ($job_id, gitignored)" >&2

[ -n "$tls" ] || exit 0
case "$shards$workers" in
  *[!0-9]* | '') echo "make-secret: SHARDS and WORKERS are counts" >&2; exit 2 ;;
esac
command -v openssl >/dev/null || { echo "make-secret: --tls needs openssl" >&2; exit 1; }
sans=()
for ((i = 0; i < shards; i++)); do sans+=("rubato-ps-$i.rubato-ps"); done
for ((i = 0; i < workers; i++)); do sans+=("rubato-worker-$i.rubato-ring"); done
if [ -n "$namespace" ]; then
  for n in "${sans[@]}"; do sans+=("$n.$namespace.svc.cluster.local"); done
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
san_list=$(printf 'DNS:%s,' "${sans[@]}")
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
  "${san_list%,}" > "$work/ext"
ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
openssl req -x509 "${ec[@]}" -days 30 -subj "/CN=rubato job CA" \
  -keyout "$work/ca.key" -out "$work/ca.crt" 2>/dev/null
openssl req "${ec[@]}" -subj "/CN=rubato" -keyout "$work/tls.key" -out "$work/tls.csr" 2>/dev/null
openssl x509 -req -in "$work/tls.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
  -days 30 -extfile "$work/ext" -out "$work/tls.crt" 2>/dev/null
for f in ca.crt tls.crt tls.key; do
  install -m 600 "$work/$f" "components/tls/$f"
done
echo "make-secret: wrote $(pwd)/components/tls/{ca.crt,tls.crt,tls.key} for ${#sans[@]} names" \
  "(${sans[0]} ...); the CA's key is gone" >&2
