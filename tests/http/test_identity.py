"""Who owns what a request stores, and query numbers that never become a 500 (sans-IO)."""

from __future__ import annotations

from direct_frontend.fleet.schema import AuthConfig
from direct_frontend.http.identity import owner_of
from direct_frontend.http.query import query_int

ALICE, BOB = "alice-key-0123", "bob-key-4567"


def scope(*headers: tuple[str, str]) -> dict[str, object]:
    return {"headers": [(k.encode(), v.encode()) for k, v in headers]}


def test_each_key_is_an_owner_that_reveals_nothing_of_the_key() -> None:
    auth = AuthConfig(api_keys=(ALICE, BOB))
    alice = owner_of(auth, scope(("authorization", f"Bearer {ALICE}")))
    assert alice == owner_of(auth, scope(("x-api-key", ALICE)))  # Anthropic's header
    assert alice != owner_of(auth, scope(("authorization", f"Bearer {BOB}")))
    assert ALICE not in alice and len(alice) == 33
    assert owner_of(AuthConfig(), scope(("authorization", f"Bearer {ALICE}"))) == ""


def test_a_tenant_header_narrows_the_owner_within_its_key() -> None:
    auth = AuthConfig(api_keys=(ALICE, BOB), tenant_header="X-Tenant")
    key = ("authorization", f"Bearer {ALICE}")
    team_a = owner_of(auth, scope(key, ("x-tenant", "team-a")))
    team_b = owner_of(auth, scope(key, ("x-tenant", "team-b")))
    assert len({team_a, team_b, owner_of(auth, scope(key))}) == 3
    bob_as_team_a = owner_of(auth, scope(("authorization", f"Bearer {BOB}"),
                                         ("x-tenant", "team-a")))
    assert bob_as_team_a != team_a  # no header reaches another key's objects
    assert "team-a" not in team_a


def test_query_numbers_are_ascii_digits_in_range() -> None:
    assert query_int("20", 1, 100) == 20 and query_int("-1", -1, 10) == -1
    for raw in ("0", "101", "9" * 5000, "\u00b2", "\u0663", "", "-", "1.5", " 1", "-2"):
        assert query_int(raw, 1 if raw != "-2" else -1, 100) is None
