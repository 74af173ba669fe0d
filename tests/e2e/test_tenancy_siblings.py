"""Two API keys across processes: a sibling replica (over a real nats-server) and the
workers of ``run --workers`` answer another key's stored response as not found, and the
owner's as found, whichever process holds it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_replicas import FAST, SLOW, fleet, peers_of, replicas
from tests.e2e.test_workers import fresh_get, worker_service
from tests.support.daemon import sim_engine, wait_for
from tests.support.http import http
from tests.support.nats import nats_binary, running_nats

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="needs nats-server")

ALICE, BOB = "alice-key-0f1e2d3c4b5a", "bob-key-a5b4c3d2e1f0"
AUTH = f'[frontend.auth]\napi_keys = ["{ALICE}", "{BOB}"]\n'


def as_key(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_another_key_gets_not_found_through_a_sibling_replica(
    model_dir: Path, tmp_path: Path
) -> None:
    engines = [sim_engine("e0", "sglang", **SLOW)]
    with running_nats() as nats, replicas(tmp_path, model_dir, engines, nats.url, 2,
                                          frontend_extra=AUTH) as (first, second):
        for daemon in (first, second):
            wait_for(lambda d=daemon: len(peers_of(d)) == 1, what="the sibling heard")
        ask = {"model": "demo", "max_output_tokens": 4}
        stored = http.post(first.url + "/v1/responses", json={**ask, "input": "hi"},
                            headers=as_key(ALICE)).json()
        running = http.post(first.url + "/v1/responses", headers=as_key(ALICE), json={
            **ask, "input": "go on", "background": True, "max_output_tokens": 2000}).json()
        for response_id in (stored["id"], running["id"]):
            url = f"{second.url}/v1/responses/{response_id}"
            assert http.get(url, headers=as_key(BOB)).status_code == 404
            assert http.get(url, params={"stream": "true"},
                             headers=as_key(BOB)).status_code == 404
            assert http.get(url + "/input_items", headers=as_key(BOB)).status_code == 404
            assert http.post(url + "/cancel", headers=as_key(BOB)).status_code == 404
            assert http.delete(url, headers=as_key(BOB)).status_code == 404
            continued = http.post(second.url + "/v1/responses", headers=as_key(BOB), json={
                **ask, "input": "more", "previous_response_id": response_id})
            assert continued.json()["error"]["code"] == "previous_response_not_found"
            assert http.get(url, headers=as_key(ALICE)).status_code == 200
        url = f"{second.url}/v1/responses/{running['id']}"
        assert http.post(url + "/cancel", headers=as_key(ALICE)).json()["status"] == "cancelled"
        assert http.delete(f"{second.url}/v1/responses/{stored['id']}",
                            headers=as_key(ALICE)).json()["deleted"]
        assert fleet(second)["replicas"]["counts"]["response_fetches_failed"] == 0


def test_another_key_gets_not_found_from_every_worker(model_dir: Path, tmp_path: Path) -> None:
    with worker_service(tmp_path, model_dir, 2, FAST, frontend_extra=AUTH) as (base, _, _):
        made = http.post(base + "/v1/responses", headers=as_key(ALICE), json={
            "model": "demo", "input": "hi", "max_output_tokens": 4}).json()
        url = f"{base}/v1/responses/{made['id']}"
        workers = set()
        for _ in range(12):  # a connection each: the kernel spreads them over the workers
            theirs = fresh_get(url, as_key(BOB))
            assert theirs.status_code == 404
            workers.add(fresh_get(base + "/fleet").json()["replicas"]["replica"])
            assert fresh_get(url, as_key(ALICE)).status_code == 200
        assert len(workers) == 2
