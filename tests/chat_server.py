"""A real OpenAI-compatible chat-completions server on 127.0.0.1 for the labeller tests."""

import json
import socket
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ScriptedEndpoint:
    """A real HTTP server on 127.0.0.1 speaking /v1/chat/completions and /v1/models. `behave(content, attempt)`
    gets the user message and the 1-based attempt number for that message and returns (status, payload, delay_s);
    a str payload is the assistant's reply, a dict is sent as the JSON body, bytes are sent as they are, None
    closes the connection without an answer (a connection failure). /v1/models lists `models` (None: 404)."""

    def __init__(self, behave, models=("judge",)):
        self.behave, self.models, self.lock, self.stop = behave, models, threading.Lock(), threading.Event()
        self.in_flight = self.max_in_flight = 0
        self.attempt_times = defaultdict(list)  # user message -> arrival times
        self.auth_headers = set()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send_json(self, status, data: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if endpoint.models is None or self.path.rstrip("/") != "/v1/models":
                    self.send_json(404, json.dumps({"error": {"message": "not found"}}).encode())
                    return
                models = [{"id": name, "object": "model", "created": 0, "owned_by": "test"} for name in endpoint.models]
                self.send_json(200, json.dumps({"object": "list", "data": models}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                content = body["messages"][-1]["content"]
                with endpoint.lock:
                    endpoint.in_flight += 1
                    endpoint.max_in_flight = max(endpoint.max_in_flight, endpoint.in_flight)
                    endpoint.attempt_times[content].append(time.monotonic())
                    endpoint.auth_headers.add(self.headers.get("Authorization"))
                    attempt = len(endpoint.attempt_times[content])
                done = False

                def finish():  # before the reply leaves: a client may send its next request the moment it has it
                    nonlocal done
                    if not done:
                        done = True
                        with endpoint.lock:
                            endpoint.in_flight -= 1

                try:
                    status, payload, delay = endpoint.behave(content, attempt)
                    endpoint.stop.wait(delay)
                    finish()
                    if payload is None:
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if isinstance(payload, str):
                        payload = {
                            "id": "c",
                            "object": "chat.completion",
                            "created": 0,
                            "model": body["model"],
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": payload},
                                }
                            ],
                        }
                    self.send_json(status, payload if isinstance(payload, bytes) else json.dumps(payload).encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout)
                finally:
                    finish()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
