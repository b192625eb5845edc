"""A stand-in for vLLM's OpenAI server process, for the launcher's tests without vLLM (tests/test_live_launcher.py).

Run as the launcher runs vLLM (`python -m vllm.entrypoints.openai.api_server --model M --host H --port P ...`, this
folder first on PYTHONPATH). What the launcher relies on is done as vLLM 0.32 does it: the port bound with
SO_REUSEADDR and no SO_REUSEPORT, before start-up (`setup_server`), so a taken port ends the process with
EADDRINUSE; `--api-key` / VLLM_API_KEY guard /v1 (`AuthenticationMiddleware`); `/v1/models` cards with
`max_model_len`; `/metrics` with `process_start_time_seconds`; a completion with `choices`. FAKE_VLLM_GATE names a
file it waits for before binding its port (a test orders events by it). Flags it does not know are ignored.
"""

import argparse
import json
import os
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STARTED = time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--served-model-name", nargs="+")
    ap.add_argument("--api-key", nargs="+")
    ap.add_argument("--max-model-len", type=int, default=64)
    args, _ = ap.parse_known_args()
    keys = [k for k in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if k]
    model = (args.served_model_name or [args.model])[0]
    print("fake vLLM argv:", json.dumps(sys.argv[1:]), flush=True)
    gate = os.environ.get("FAKE_VLLM_GATE")
    while gate and not os.path.exists(gate):
        time.sleep(0.02)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"OSError: [Errno {e.errno}] error while attempting to bind on address ({args.host!r}, {args.port}): "
              f"{e.strerror}", flush=True)
        sys.exit(1)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self, status, body, ctype="application/json"):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def guarded(self):
            if not keys or not self.path.startswith("/v1"):
                return False
            scheme, _, token = self.headers.get("Authorization", "").partition(" ")
            if scheme.lower() == "bearer" and token in keys:
                return False
            self.answer(401, {"error": "Unauthorized"})
            return True

        def do_GET(self):
            if self.guarded():
                return
            if self.path == "/v1/models":
                card = {"id": model, "object": "model", "owned_by": "vllm", "root": args.model,
                        "max_model_len": args.max_model_len}
                self.answer(200, {"object": "list", "data": [card]})
            elif self.path == "/metrics":
                self.answer(200, f"process_start_time_seconds {STARTED}\n".encode(), "text/plain")
            elif self.path == "/health":
                self.answer(200, b"", "text/plain")
            else:
                self.answer(404, {"detail": "Not Found"})

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.guarded():
                return
            if self.path in ("/v1/completions", "/v1/chat/completions"):
                req = json.loads(body or b"{}")
                self.answer(200, {"id": "cmpl-fake", "object": "text_completion", "model": model, "pid": os.getpid(),
                                  "choices": [{"index": 0, "text": "x"}],
                                  "echo_auth": self.headers.get("Authorization"),  # what the worker was sent
                                  "usage": {"prompt_tokens": 1, "completion_tokens": int(req.get("max_tokens") or 1)}})
            else:
                self.answer(404, {"detail": "Not Found"})

    server = ThreadingHTTPServer((args.host, args.port), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_activate()
    print(f"fake vLLM serving {model} on port {args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
