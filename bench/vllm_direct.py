"""Plain vLLM (``vllm serve``), no hybridpd: the baseline users would otherwise run.

The vLLM environment (``.venv-vllm``, ``make bootstrap-vllm``; or
``HYBRIDPD_VLLM_VENV``) provides ``vllm`` and builds the tiny Qwen3-Next that
our ``--engine vllm`` stack serves too, so both run the same model with the
same caching settings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from hybridpd.errors import UnavailableError
from hybridpd.procs import free_port


def vllm_venv() -> Path | None:
    """The vLLM environment, if it exists."""
    venv = Path(os.environ.get("HYBRIDPD_VLLM_VENV", ".venv-vllm")).absolute()
    return venv if (venv / "bin" / "vllm").exists() else None


def tiny_model(venv: Path) -> Path | str:
    """The model both vLLM variants serve: ``HYBRIDPD_MODEL`` when set (a directory or an
    HF id, as for ``hybridpd up``), else the tiny Qwen3-Next (built by the vLLM
    environment's Python on first use)."""
    if os.environ.get("HYBRIDPD_MODEL", "tiny") != "tiny":
        return os.environ["HYBRIDPD_MODEL"]
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "hybridpd.engine.vllm.tiny"], capture_output=True, text=True, check=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


#: vLLM's own junction checkpoints (``enable_mamba_shared_prefix_checkpoint``): they act only
#: with EAGLE/MTP on the Mamba group (``hybridpd.engine.vllm.args.shared_prefix_checkpoint``),
#: so without a drafter (as here) the flag is inert and vLLM keeps its junctions rounded down
#: to its Mamba block
SHARED_PREFIX_FLAG = "--enable-mamba-shared-prefix-checkpoint"


class VllmServer:
    """``vllm serve`` on loopback, serving the model as ``tiny`` with prefix caching
    (``mamba_cache_mode=align`` at ``unit``) and, unless ``shared_prefix_checkpoint``
    is False, vLLM's own junction checkpoints (:data:`SHARED_PREFIX_FLAG`): the
    ``vllm-direct`` baseline runs vLLM's branch policy, as ``--engine vllm`` does
    under ``checkpoint_policy: branch-aware``."""

    def __init__(
        self,
        venv: Path,
        workdir: Path,
        unit: int,
        max_model_len: int,
        log_name: str = "vllm.log",
        *,
        shared_prefix_checkpoint: bool = True,
    ) -> None:
        self.venv = venv
        self.port = free_port()
        self.log = workdir / log_name
        self.argv = [
            str(venv / "bin" / "vllm"),
            "serve",
            str(tiny_model(venv)),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(max_model_len),
            "--max-num-batched-tokens",
            str(max_model_len),
            "--enable-prefix-caching",
            "--mamba-cache-mode",
            "align",
            "--prefix-match-unit",
            str(unit),
            "--enable-prompt-tokens-details",
            "--enforce-eager",
        ]
        if shared_prefix_checkpoint:
            self.argv.append(SHARED_PREFIX_FLAG)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def __enter__(self) -> VllmServer:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise UnavailableError("vllm serve did not start:\n" + self.log.read_text(errors="replace")[-3000:])
            try:
                if httpx.get(self.http + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
