"""A Kubernetes API server double for pod discovery tests: the real protocol on 127.0.0.1.

It serves what the pod watch uses, as the API server does: ``GET
/api/v1/namespaces/<ns>/pods`` with ``labelSelector`` (equality, set and
existence requirements), ``limit``/``continue`` pages and the list's
``resourceVersion``; the same path with ``watch=true`` streams one JSON
event per line in a chunked response (ADDED, MODIFIED, DELETED, BOOKMARK
with ``allowWatchBookmarks``), ends after ``timeoutSeconds``, and answers a
``resourceVersion`` older than its history with an ERROR event of a 410
Status. Pods are stored as the API server returns them (``pod`` builds one).

A test drives it: :meth:`ApiServer.put` and :meth:`ApiServer.delete` make
events; ``silent=True`` changes a pod without one (a missed event, only a
relist finds it); :meth:`ApiServer.compact` forgets history (the next
watch from before it gets 410); :meth:`ApiServer.stop` and
:meth:`ApiServer.start` take it away and bring it back on the same port,
pods kept, as an API server restart does; :meth:`ApiServer.end_watches` ends
the open watches as their timeout would. ``watch_fault`` breaks every watch
the way networks do: ``"reset"`` answers its headers and then resets the TCP
connection, ``"silent"`` answers its headers and then sends nothing, the
connection open, until the fault is cleared.
"""

from __future__ import annotations

import copy
import http.server
import json
import re
import socket
import ssl
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from direct_frontend.fleet.schema import GRPC_PORT_ANNOTATION

Pod = dict[str, Any]
_PODS_PATH = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/pods$")


def pod(
    name: str, ip: str | None, port: int | None, *, ready: bool = True,
    labels: Mapping[str, str] | None = None, namespace: str = "default", uid: str | None = None,
    annotations: Mapping[str, str] | None = None,
) -> Pod:
    """A pod as the API server shows it: running, with its IP and Ready condition."""
    notes = dict(annotations or {})
    if port is not None:
        notes[GRPC_PORT_ANNOTATION] = str(port)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status: dict[str, Any] = {
        "phase": "Running",
        "hostIP": "10.0.0.1",
        "startTime": now,
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": "True" if ready else "False",
             "lastTransitionTime": now},
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        ],
        "containerStatuses": [{"name": "engine", "ready": ready, "restartCount": 0,
                               "image": "engine:latest", "imageID": "", "started": True,
                               "state": {"running": {"startedAt": now}}}],
    }
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "creationTimestamp": now,
            "labels": dict(labels or {"app": "engine"}),
            "annotations": notes,
        },
        "spec": {"containers": [{"name": "engine", "image": "engine:latest",
                                 "ports": [{"containerPort": port or 50051}]}],
                 "nodeName": "node-1"},
        "status": status,
    }


def set_ready(item: Pod, ready: bool) -> Pod:
    changed = copy.deepcopy(item)
    for condition in changed["status"]["conditions"]:
        if condition["type"] in ("Ready", "ContainersReady"):
            condition["status"] = "True" if ready else "False"
    return changed


def matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Whether ``labels`` satisfy a label selector (the requirements the API server knows)."""
    for term in re.split(r",(?![^()]*\))", selector):
        term = term.strip()
        if not term:
            continue
        if found := re.match(r"^(\S+)\s+(in|notin)\s+\((.*)\)$", term):
            key, op, values = found[1], found[2], {v.strip() for v in found[3].split(",")}
            inside = key in labels and labels[key] in values
            if inside != (op == "in"):
                return False
        elif found := re.match(r"^([^!=\s]+)\s*(==|=|!=)\s*(\S*)$", term):
            key, op, value = found[1], found[2], found[3]
            if (labels.get(key) == value) != (op != "!="):
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


class ApiServer:
    """The API server double (a thread per connection, as a real server's clients see it)."""

    def __init__(self, *, bookmark_interval_s: float = 0.3) -> None:
        self.bookmark_interval_s = bookmark_interval_s
        #: the bearer token it accepts (a test rotates it, as a cloud's token service does)
        self.token = "test-token"
        #: requests it refused with 401
        self.refused = 0
        self.pods: dict[tuple[str, str], Pod] = {}  # by (namespace, name)
        self.history: list[tuple[int, str, Pod]] = []  # (resourceVersion, type, pod)
        self.version = 100
        self.oldest = 100  # a watch from before this gets 410
        self.requests: list[str] = []  # "list" / "watch", in order
        self.watching = 0
        #: None, or how every watch fails: "reset" (a TCP reset) or "silent" (no bytes)
        self.watch_fault: str | None = None
        self.cond = threading.Condition()
        self.port = 0
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._generation = 0  # bumped by stop(): open watches end

    # -- the test's side ----------------------------------------------------------------

    def put(self, item: Pod, *, silent: bool = False) -> Pod:
        """Create or replace a pod (ADDED or MODIFIED), or change it without an event."""
        with self.cond:
            key = (item["metadata"]["namespace"], item["metadata"]["name"])
            stored = copy.deepcopy(item)
            self.version += 1
            stored["metadata"]["resourceVersion"] = str(self.version)
            kind = "MODIFIED" if key in self.pods else "ADDED"
            self.pods[key] = stored
            if not silent:
                self.history.append((self.version, kind, stored))
            self.cond.notify_all()
            return stored

    def delete(self, name: str, namespace: str = "default", *, silent: bool = False) -> None:
        with self.cond:
            stored = self.pods.pop((namespace, name))
            self.version += 1
            gone = copy.deepcopy(stored)
            gone["metadata"]["resourceVersion"] = str(self.version)
            if not silent:
                self.history.append((self.version, "DELETED", gone))
            self.cond.notify_all()

    def terminating(self, name: str, namespace: str = "default") -> None:
        """Set the pod's deletion timestamp (a graceful delete under way): MODIFIED."""
        item = copy.deepcopy(self.pods[(namespace, name)])
        item["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ")
        item["metadata"]["deletionGracePeriodSeconds"] = 30
        self.put(item)

    def compact(self) -> None:
        """Forget the history (etcd compaction): a watch from an older version gets 410."""
        with self.cond:
            self.history.clear()
            self.version += 1
            self.oldest = self.version
            self._generation += 1  # open watches end, as a compaction's do
            self.cond.notify_all()

    def end_watches(self) -> None:
        """End every open watch now, as its ``timeoutSeconds`` would (a test need not wait
        for a whole second, the least a watch may ask for)."""
        with self.cond:
            self._generation += 1
            self.cond.notify_all()

    def set_watch_fault(self, fault: str | None) -> None:
        """Break every watch from now on (see ``watch_fault``), or mend them (None)."""
        with self.cond:
            self.watch_fault = fault
            self.cond.notify_all()

    def get(self, name: str, namespace: str = "default") -> Pod:
        with self.cond:
            return copy.deepcopy(self.pods[(namespace, name)])

    # -- running ------------------------------------------------------------------------

    def start(self, tls: ssl.SSLContext | None = None) -> ApiServer:
        """Listen (again, on the same port after :meth:`stop`); HTTPS with ``tls``."""
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        server.daemon_threads = True
        if tls is not None:
            server.socket = tls.wrap_socket(server.socket, server_side=True)
        self.port = server.server_address[1]
        self._server = server
        # polled often, so a stop (every test's teardown) does not wait half a second
        self._thread = threading.Thread(target=server.serve_forever, name="apiserver",
                                        kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and end every open watch (the pods are kept for a restart)."""
        if self._server is None:
            return
        with self.cond:
            self._generation += 1
            self.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        assert self._thread is not None
        self._thread.join(10)
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path, user: Mapping[str, Any] | None = None) -> Path:
        """A kubeconfig file for this server: a token user as a service account has, or ``user``.

        ``user`` is a kubeconfig user entry, e.g. ``{"exec": {...}}`` for a credential plugin.
        """
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": dict(user or {"token": "test-token"})}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                      "namespace": "default"}}],
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # -- the protocol ---------------------------------------------------------------------

    def list_pods(self, namespace: str, query: Mapping[str, str]) -> tuple[int, dict[str, Any]]:
        with self.cond:
            self.requests.append("list")
            selector = query.get("labelSelector", "")
            items = [copy.deepcopy(p) for (ns, _), p in sorted(self.pods.items())
                     if ns == namespace and matches(selector, p["metadata"].get("labels", {}))]
            version = self.version
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0) or len(items) or 1
        page = items[start:start + limit]
        metadata: dict[str, Any] = {"resourceVersion": str(version)}
        if start + limit < len(items):
            metadata["continue"] = str(start + limit)
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": page}

    def watch_events(
        self, namespace: str, query: Mapping[str, str]
    ) -> Iterator[dict[str, Any]]:
        """The events a watch streams, until its timeout, a restart or a compaction."""
        selector = query.get("labelSelector", "")
        since = int(query.get("resourceVersion") or 0)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        with self.cond:
            self.requests.append("watch")
            generation = self._generation
            if since < self.oldest:
                yield {"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": f"too old resource version: {since} ({self.oldest})",
                    "reason": "Expired", "code": 410}}
                return
            self.watching += 1
        try:
            next_bookmark = time.monotonic() + self.bookmark_interval_s
            while True:
                with self.cond:
                    if generation != self._generation:
                        return
                    fresh = [(v, t, p) for v, t, p in self.history if v > since]
                    if not fresh:
                        now = time.monotonic()
                        if now >= deadline:
                            return
                        if bookmarks and now >= next_bookmark:
                            next_bookmark = now + self.bookmark_interval_s
                            yield {"type": "BOOKMARK", "object": {
                                "kind": "Pod", "apiVersion": "v1",
                                "metadata": {"resourceVersion": str(self.version)}}}
                            since = max(since, self.version)
                            continue
                        self.cond.wait(min(deadline, next_bookmark) - now)
                        continue
                for version, kind, item in fresh:
                    since = version
                    if item["metadata"]["namespace"] == namespace and matches(
                        selector, item["metadata"].get("labels", {})
                    ):
                        yield {"type": kind, "object": item}
        finally:
            with self.cond:
                self.watching -= 1


def service_account(directory: Path, namespace: str = "default") -> ssl.SSLContext:
    """A pod's service-account directory for the double (token, ca.crt, namespace).

    Returns the server side of its TLS: a self-signed certificate for
    127.0.0.1, which ``ca.crt`` trusts, as a cluster's CA does its API server's.
    """
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / "ca.crt", directory / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )
    (directory / "token").write_text("test-token")
    (directory / "namespace").write_text(namespace)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def _handler(api: ApiServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            found = _PODS_PATH.match(parts.path)
            if found is None:
                self._json(404, {"kind": "Status", "code": 404})
                return
            if self.headers.get("Authorization") != f"Bearer {api.token}":
                with api.cond:
                    api.refused += 1
                self._json(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
                return
            if query.get("watch") in ("true", "1"):
                self._watch(found["ns"], query)
            else:
                self._json(*api.list_pods(found["ns"], query))

        def _json(self, status: int, body: Mapping[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _watch(self, namespace: str, query: Mapping[str, str]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            with api.cond:
                fault = api.watch_fault
            if fault is not None:
                self._fail(fault)
                return
            try:
                for event in api.watch_events(namespace, query):
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass  # the client went away
            self.close_connection = True

        def _fail(self, fault: str) -> None:
            with api.cond:
                api.requests.append("watch")
                generation = api._generation
            self.wfile.flush()
            if fault == "silent":  # open and mute until the fault is cleared or the server stops
                with api.cond:
                    api.cond.wait_for(lambda: api.watch_fault != "silent"
                                      or api._generation != generation)
            else:  # "reset": close with SO_LINGER 0, which sends RST instead of FIN
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.connection.close()
            self.close_connection = True

    return Handler
