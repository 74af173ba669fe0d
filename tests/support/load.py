"""Streaming load for end-to-end tests: clients back to back, every outcome kept."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from tests.support.daemon import wait_for


class Load:
    """Clients streaming chat completions back to back until stopped; every outcome kept."""

    def __init__(self, url: str, clients: int = 6, max_tokens: int = 20) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(clients)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _client(self) -> None:
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": self.max_tokens, "stream": True}
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                outcome = self._one(client, body)
                with self._lock:
                    if outcome is None:
                        self.ok += 1
                    else:
                        self.failures.append(outcome)

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> str | None:
        try:
            with client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                text = "".join(r.iter_text())
        except httpx.HTTPError as exc:
            return f"transport: {exc!r}"
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {text[:200]}"
        if '"error"' in text or not text.rstrip().endswith("data: [DONE]"):
            return f"bad stream: {text[-200:]}"
        if '"finish_reason":"length"' not in text:
            return f"stream ended early: {text[-200:]}"
        return None

    def wait_more(self, count: int) -> None:
        start = self.ok
        wait_for(lambda: self.ok >= start + count, 20, f"{count} more requests")
