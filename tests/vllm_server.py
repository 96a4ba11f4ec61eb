"""A stand-in for vLLM's OpenAI server on 127.0.0.1, for the faults a real server cannot be made to show on demand
(tests/test_sampler_server.py: slow replies, bursts of 5xx answers, no runtime LoRA routes); everything else is tested
against a real vLLM server (tests/test_vllm.py). It answers `--sampler vllm`'s calls in vLLM's shapes
(vllm/entrypoints/openai), backed by a transformers + peft model on CPU:

    GET  /v1/models                  base model card (max_model_len) + one card per loaded LoRA adapter
    POST /v1/completions             token-id prompt, n=1, no streaming; logprobs with return_tokens_as_token_ids
    POST /v1/load_lora_adapter       {"lora_name", "lora_path"}; 200 with a plain-text "Success: ..." body

Errors are vLLM's {"error": {"message", "type", "param", "code"}}; a route that is switched off (runtime LoRA
updating not allowed) is FastAPI's 404 {"detail": "Not Found"}.

restart_during_run: the real server (benchmarks/vllm_cpu.py) killed and started again in the middle of a run, for the
tests that check a run outlives it (tests/test_vllm.py, tests/test_async.py).
"""

import contextlib
import json
import subprocess
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import torch


def logged(root: Path, update: int) -> bool:
    """Whether a run under root has written its metrics row of `update` (whole lines: a row may be half written)."""
    lines = [line for path in root.glob("*/metrics.jsonl") for line in path.read_text().splitlines(keepends=True)]
    return any(line.endswith("\n") and json.loads(line)["update"] == update for line in lines)


def restart_during_run(server, run: subprocess.Popen, run_log: Path, run_root: Path, timeout_s: float = 300) -> int:
    """Once the run (a script's process, its run directory under run_root) has logged update 1: SIGKILL of the server
    (a benchmarks.vllm_cpu.VllmServer) with its EngineCore / Worker children, all checked gone; 5 s later the run must
    be waiting, not failed; the server is started again on the same port and the run must end with exit code 0 (it is
    killed if not). Returns the length of the server's log at the kill: what the restarted server logged follows it."""
    try:
        deadline = time.monotonic() + timeout_s
        while not logged(run_root, 1):
            assert run.poll() is None and time.monotonic() < deadline, run_log.read_text()[-3000:]
            time.sleep(0.2)
        tree = [server.process.pid, *(p.pid for p in psutil.Process(server.process.pid).children(recursive=True))]
        server.kill()
        assert not [pid for pid in tree if psutil.pid_exists(pid)]  # the engine and its worker went with it
        killed_at = server.log_file.stat().st_size
        time.sleep(5)
        assert run.poll() is None, run_log.read_text()[-3000:]  # waiting for the server, not failed
        server.start()
        assert run.wait(timeout=600) == 0, run_log.read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    return killed_at


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


class TinyVllmServer:
    """`with TinyVllmServer(model_dir) as server:` serves model_dir (under its path, as `vllm serve PATH`) on
    server.url (".../v1") from a background thread. Faults: runtime_lora (False: the LoRA routes are absent), delay_s
    (before every completion) and fail_completions (that many 500s first)."""

    def __init__(self, model_dir, *, runtime_lora: bool = True, delay_s: float = 0.0, fail_completions: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir, self.runtime_lora = str(model_dir), runtime_lora
        self.delay_s, self.fail_completions = delay_s, fail_completions
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.adapters: dict[str, str] = {}  # lora name -> path, in load order
        self.model_lock, self.count_lock = threading.Lock(), threading.Lock()
        self.in_flight = self.max_in_flight = self.completions = 0
        self.rng = torch.Generator().manual_seed(0)
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, like uvicorn

            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer(lambda: server.models() if self.path == "/v1/models" else None)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                routes = {"/v1/completions": server.completion}
                if server.runtime_lora:  # vLLM registers it only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true
                    routes["/v1/load_lora_adapter"] = server.load
                route = routes.get(self.path)
                self._answer(lambda: route(body) if route else None)

            def _answer(self, handle):
                try:
                    result = handle()
                    status, payload = (404, {"detail": "Not Found"}) if result is None else (200, result)
                except HTTPError as error:
                    status = error.status
                    payload = {
                        "error": {"message": str(error), "type": error.kind, "param": error.param, "code": status}
                    }
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # a client that gave up (timeout, deadline) closed its connection: nothing to report

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        deadline = time.monotonic() + 30
        while self.in_flight and time.monotonic() < deadline:  # a request abandoned by its client still runs torch
            time.sleep(0.05)
        self.httpd.server_close()

    # ---- routes ----
    def models(self) -> dict:
        card = dict(object="model", created=int(time.time()), owned_by="vllm", permission=[])
        base = {**card, "id": self.model_dir, "root": self.model_dir, "parent": None,
                "max_model_len": self.model.config.max_position_embeddings}  # fmt: skip
        adapters = [{**card, "id": name, "root": path, "parent": self.model_dir, "max_model_len": None}
                    for name, path in self.adapters.items()]  # fmt: skip
        return {"object": "list", "data": [base, *adapters]}

    def load(self, body: dict) -> str:
        name, path = body["lora_name"], body["lora_path"]
        with self.model_lock:
            if not hasattr(self.model, "peft_config"):
                from peft import PeftModel

                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
            else:
                self.model.load_adapter(path, adapter_name=name)
        self.adapters[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def completion(self, body: dict) -> dict:
        with self.count_lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.completions += 1
            fail = self.completions <= self.fail_completions
        try:
            time.sleep(self.delay_s)
            if fail:
                raise HTTPError(500, "injected failure", "InternalServerError")
            name, prompt = body["model"], body["prompt"]
            with self.model_lock:
                tokens, logprobs, finish = self.sample(prompt, body, adapter=name if name in self.adapters else None)
            names = [f"token_id:{t}" for t in tokens]
            logprobs_field = {
                "text_offset": [sum(len(n) for n in names[:i]) for i in range(len(names))],
                "token_logprobs": logprobs,
                "tokens": names,
                "top_logprobs": [{n: lp} for n, lp in zip(names, logprobs)],
            }
            choice = {"index": 0, "text": self.tokenizer.decode(tokens, skip_special_tokens=True),
                      "logprobs": logprobs_field, "finish_reason": finish, "stop_reason": None}  # fmt: skip
            usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(tokens),
                     "completion_tokens": len(tokens)}  # fmt: skip
            return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": name, "choices": [choice], "usage": usage}  # fmt: skip
        finally:
            with self.count_lock:
                self.in_flight -= 1

    # ---- the engine ----
    @torch.no_grad()
    def sample(self, prompt: list[int], body: dict, adapter: str | None):
        """Token by token with a KV cache at body's temperature; the sampled token's logprob. Stops after the EOS or
        a stop token id (kept, as vLLM keeps them in token_ids)."""
        temperature = float(body.get("temperature", 1.0))
        stop_ids = {self.tokenizer.eos_token_id, *(body.get("stop_token_ids") or [])}
        if adapter is not None:
            self.model.set_adapter(adapter)
        base_only = adapter is None and hasattr(self.model, "peft_config")
        tokens, logprobs, finish = [], [], "length"
        with self.model.disable_adapter() if base_only else contextlib.nullcontext():
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
            for _ in range(int(body["max_tokens"])):
                logits = out.logits[0, -1].float()
                processed = torch.log_softmax(logits / max(temperature, 1e-5), -1)
                token = int(logits.argmax() if temperature < 1e-5 else torch.multinomial(processed.exp(), 1,
                                                                                         generator=self.rng))  # fmt: skip
                tokens.append(token)
                logprobs.append(float(processed[token]))
                if token in stop_ids:
                    finish = "stop"
                    break
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        return tokens, logprobs, finish
