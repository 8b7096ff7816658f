#!/usr/bin/env bash
# The GPU tier, in one prepared run for a lent GPU machine (no network there).
#
#   bash scripts/gpu_check.sh [OUT_DIR]
#
# Uses the machine's own python3 with torch+CUDA. Python packages it lacks
# (pydantic, cbor2) travel as wheels in .whl/, fetched beforehand on a machine with
# network: pip download --only-binary=:all: --python-version 3.11 -d .whl pydantic cbor2
# Runs tests/gpu, then bench.gpu_check in
# fp32 and bf16: the tiny hybrid on CUDA with prefix caching and EAGLE, printing
# hit tokens, acceptance length, TTFT and token equality with a plain run.
# Every step runs even when an earlier one fails; the exit status is the worst.
set -u
out=${1:-${OUT:-runs/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HYBRIDPD_HOME=${HYBRIDPD_HOME:-/tmp/hybridpd-home}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hybridpd-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/hybridpd-site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
status=0
step() { echo "== $*"; "$@" || status=1; }
step nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' || status=1
step python3 -m pytest -p no:cacheprovider -o addopts= -q -rA --junitxml="$out/gpu-tests.xml" tests/gpu
for dt in float32 bfloat16; do
  step python3 -m bench.gpu_check --device cuda --dtype "$dt" --json "$out/gpu_check_$dt.json"
done
# The vLLM GPU tier: the same tests/vllm as on CPU, on CUDA. vLLM is not in the
# lent machines' image and its CUDA wheel is larger than what may travel there,
# so this runs only where vLLM is installed.
if python3 -c "import vllm" 2>/dev/null; then
  step env HYBRIDPD_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -o addopts= -q -rA tests/vllm
else
  echo "== vLLM is not installed here: vLLM GPU tier skipped"
fi
echo "== gpu_check.sh finished with status $status"
exit $status
