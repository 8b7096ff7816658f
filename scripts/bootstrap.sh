#!/usr/bin/env bash
# Idempotent bootstrap of everything hybridpd needs on a fresh machine:
#   1. Debian libraries (as root): Mooncake's RDMA libs, Prometheus' promtool.
#   2. .venv with the pinned Python dependencies, NIXL the lean way, and
#      hybridpd itself (editable).
# Re-running is cheap: each step is skipped when its stamp is current.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
# Mooncake needs the RDMA libs; prometheus brings promtool + a server for the observability tests.
APT_PKGS=(libibverbs1 libnl-3-200 libnl-route-3-200 prometheus)

log() { printf '[bootstrap] %s\n' "$*"; }

missing_apt=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing_apt+=("$p")
done
if ((${#missing_apt[@]})); then
  if [ "$(id -u)" = 0 ]; then
    log "apt-get install ${missing_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing_apt[@]}" >/dev/null
  else
    log "WARNING: missing Debian packages ${missing_apt[*]} (run as root or: sudo apt-get install ${missing_apt[*]})"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

# The stamp records the inputs of the pip step; change any of them and it reruns.
stamp="$VENV/.hybridpd-bootstrap"
want=$(cat requirements/*.txt pyproject.toml scripts/bootstrap.sh hybridpd/_cbor_tokens.c | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "pip install (pinned; progress below)"
  "$VENV/bin/pip" install --progress-bar off -q -r requirements/dev.txt
  # NIXL without its deps: the meta package would pull a multi-GB CUDA torch.
  "$VENV/bin/pip" install --progress-bar off -q --no-deps -r requirements/nixl.txt
  "$VENV/bin/pip" install --progress-bar off -q --no-deps --no-build-isolation -e .
  echo "$want" >"$stamp"
  log "python environment ready"
else
  log "python environment up to date"
fi

# Test-only: the Prometheus Operator CRD schemas, compiled to validators by the
# npm package @kubernetes-models/prometheus-operator (used by the Helm chart tests).
NPM_DIR=.cache/npm
NPM_PKGS="@kubernetes-models/prometheus-operator@6.0.0"
if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    log "apt-get install nodejs npm"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  else
    log "WARNING: npm missing (sudo apt-get install nodejs npm); the Helm CRD tests will fail"
  fi
fi
if command -v npm >/dev/null 2>&1 && [ "$(cat "$NPM_DIR/.stamp" 2>/dev/null)" != "$NPM_PKGS" ]; then
  log "npm install $NPM_PKGS"
  mkdir -p "$NPM_DIR"
  npm install --prefix "$NPM_DIR" --no-audit --no-fund --loglevel=error $NPM_PKGS >/dev/null
  echo "$NPM_PKGS" >"$NPM_DIR/.stamp"
fi
