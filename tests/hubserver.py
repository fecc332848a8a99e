"""A fake Hugging Face Hub on 127.0.0.1 for tests: the endpoints huggingface_hub's create_repo and
upload_folder call, nothing more.

    POST /api/repos/create                           -> {"url"}; 409 when the repo exists
    POST /api/validate-yaml                          -> no errors (README.md front matter)
    POST /api/{type}s/{org}/{name}/preupload/{rev}   -> every file "regular": contents come inline
    POST /api/{type}s/{org}/{name}/commit/{rev}      -> NDJSON: header + one base64 "file" per line

Answering "regular" for every file keeps the client off the LFS and Xet upload paths. Anything
else is answered 404 and (except the client's own best-effort lookups in IGNORED) recorded, so a test can assert that nothing unexpected was asked.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAKE_TOKEN = "hf_dummySecretTokenThatMustNeverBeLogged"  # what the tests put in HF_TOKEN

# best-effort lookups the client makes on its own (an agent registry); a 404 is fine for them
IGNORED = {"/api/agent-harnesses"}
REPO = r"(?P<type>model|dataset|space)s/(?P<repo>[^/]+/[^/]+)"


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict] = {}          # repo_id -> {"private", "files": {path: bytes}}
        self.requests: list[dict] = []            # method, path, headers of every request
        self.unhandled: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the test reads hub.requests instead
            pass

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def _send(self, status: int, payload, headers: dict | None = None) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _not_found(self, message: str, code: str = "EntryNotFound") -> None:
            self._send(404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

        def do_GET(self):
            with hub.lock:
                hub.requests.append({"method": "GET", "path": self.path, "headers": dict(self.headers)})
                if self.path not in IGNORED:
                    hub.unhandled.append(f"GET {self.path}")
            self._not_found("not implemented by the fake hub")

        do_HEAD = do_GET

        def do_POST(self):
            body = self._body()
            path = self.path.split("?")[0]
            with hub.lock:
                hub.requests.append({"method": "POST", "path": self.path, "headers": dict(self.headers)})
            if path == "/api/repos/create":
                return self._create(json.loads(body))
            if path == "/api/validate-yaml":
                return self._send(200, {"errors": [], "warnings": []})
            m = re.fullmatch(rf"/api/{REPO}/(?P<op>preupload|commit)/(?P<rev>[^/]+)", path)
            if m:
                with hub.lock:
                    repo = hub.repos.get(m["repo"])
                if repo is None:
                    return self._not_found("Repository not found", "RepoNotFound")
                if m["op"] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                return self._commit(m["repo"], repo, body)
            with hub.lock:
                hub.unhandled.append(f"POST {self.path}")
            self._not_found("not implemented by the fake hub")

        def _create(self, payload: dict) -> None:
            repo_id = f"{payload['organization']}/{payload['name']}"
            with hub.lock:
                if repo_id in hub.repos:
                    return self._send(409, {"error": "You already created this model repo",
                                            "url": f"{hub.url}/{repo_id}"})
                hub.repos[repo_id] = {"private": payload.get("visibility") == "private"
                                      or payload.get("private") is True, "files": {}}
            self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

        def _commit(self, repo_id: str, repo: dict, body: bytes) -> None:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            if not lines or lines[0].get("key") != "header":
                return self._send(400, {"error": "commit payload must start with a header"})
            with hub.lock:
                for item in lines[1:]:
                    if item["key"] != "file" or item["value"].get("encoding") != "base64":
                        hub.unhandled.append(f"commit item {item['key']}")
                        continue
                    repo["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                oid = hashlib.sha1(body).hexdigest()
            self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                             "pullRequestUrl": None})

    return Handler
