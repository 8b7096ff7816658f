"""Plain vLLM (``vllm serve``), no hybridpd: the baseline users would otherwise run.

The vLLM environment (``.venv-vllm``, ``make bootstrap-vllm``; or
``HYBRIDPD_VLLM_VENV``) provides ``vllm`` and builds the tiny Qwen3-Next that
our ``--engine vllm`` stack serves too, so both run the same model with the
same caching settings. :func:`serve_argv` is that ``vllm serve`` command line, shared
with vLLM's own prefill/decode setup (``vllm-pd``, bench/vllm_pd.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from hybridpd.errors import UnavailableError
from hybridpd.procs import free_port

#: the KV and state space of every vLLM baseline server, in GiB (``VLLM_CPU_KVCACHE_SPACE``,
#: whatever the environment says): what our vLLM engine gets by default (the config's
#: ``vllm_kv_cache_memory_bytes``), so both sides run on one KV budget
KV_CACHE_GIB = 1


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


def serve_argv(
    venv: Path,
    model: Path | str,
    port: int,
    unit: int,
    max_model_len: int,
    *,
    shared_prefix_checkpoint: bool = True,
) -> list[str]:
    """``vllm serve`` of ``model`` as ``tiny`` on 127.0.0.1:``port``: bf16, prefix
    caching in ``mamba_cache_mode=align`` at ``prefix_match_unit=unit``, prompt token
    details in usage, eager; with vLLM's junction checkpoints (:data:`SHARED_PREFIX_FLAG`)
    unless ``shared_prefix_checkpoint`` is False. The one argv both vLLM baselines
    (``vllm-direct``; each server of ``vllm-pd``, bench/vllm_pd.py) start from."""
    argv = [
        str(venv / "bin" / "vllm"),
        "serve",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
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
        argv.append(SHARED_PREFIX_FLAG)
    return argv


def log_tail(path: Path, chars: int = 3000) -> str:
    """The end of a server's log (empty if there is none yet)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class VllmServer:
    """``vllm serve`` on loopback, serving the model as ``tiny`` with prefix caching
    (``mamba_cache_mode=align`` at ``unit``) and, unless ``shared_prefix_checkpoint``
    is False, vLLM's own junction checkpoints (:data:`SHARED_PREFIX_FLAG`): the
    ``vllm-direct`` baseline runs vLLM's branch policy, as ``--engine vllm`` does
    under ``checkpoint_policy: branch-aware``.

    ``extra_argv`` and ``env`` (added to the environment) are for servers that are
    one part of a setup (``vllm-pd``'s prefill and decode servers: a
    ``--kv-transfer-config`` and a NIXL side-channel port each); ``model`` skips
    resolving :func:`tiny_model` again. ``start`` / ``wait_ready`` / ``stop`` let a
    caller start several servers at once; the context manager does all three."""

    def __init__(
        self,
        venv: Path,
        workdir: Path,
        unit: int,
        max_model_len: int,
        log_name: str = "vllm.log",
        *,
        shared_prefix_checkpoint: bool = True,
        extra_argv: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        model: Path | str | None = None,
    ) -> None:
        self.venv = venv
        self.port = free_port()
        self.log = workdir / log_name
        self.argv = serve_argv(
            venv,
            tiny_model(venv) if model is None else model,
            self.port,
            unit,
            max_model_len,
            shared_prefix_checkpoint=shared_prefix_checkpoint,
        )
        self.argv.extend(extra_argv)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self) -> None:
        """Start ``vllm serve`` (returns at once; :meth:`wait_ready` waits for it)."""
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            **self.env,
        }
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=default_sigint
            )

    def exited(self) -> int | None:
        """The exit status if the server has exited (None while it runs or before start)."""
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        try:
            return httpx.get(self.http + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Wait until ``/health`` answers 200; stop it and raise ``UnavailableError``
        with its log's tail if it exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.exited() is not None or time.monotonic() > deadline:
                self.stop()
                raise UnavailableError("vllm serve did not start:\n" + log_tail(self.log))
            time.sleep(1.0)

    def stop(self) -> None:
        interrupt(self.proc, 60)

    def __enter__(self) -> VllmServer:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def default_sigint() -> None:
    """A child's SIGINT back to its default (``Popen(preexec_fn=...)``): a shell's
    background job starts with SIGINT ignored and its children inherit that, so
    :func:`interrupt` would wait out its timeout on a process started from one (a
    CI runner's, say) before Python's own handler is installed."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Stop ``proc`` as Ctrl-C would (SIGINT), killing it after ``timeout_s``
    (start it with ``preexec_fn=default_sigint``)."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
