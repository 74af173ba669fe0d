"""Each tenant's rules in the admission queue, the tier it is served at, and its name (sans-IO).

``[frontend.tenants]`` lists some tenants with their own weight, caps and
right to ``priority``; every other tenant has the defaults. A tenant's
*label* is what ``/metrics`` and a refusal call it: a listed tenant's name;
a tenant a header or body field names, by that value (at most
``max_series`` of them, the rest ``other``); an API key's tenant that is not
listed is ``other``, since its only identity is a key's. So no label ever
holds a key, and the series stay bounded.
"""

from __future__ import annotations

from typing import Final

from direct_frontend.fleet.keys import named_flow
from direct_frontend.fleet.schema import TenantConfig, TenantsConfig
from direct_frontend.openai.types import ServiceTier, Tier

#: the label of the tenants folded together (unlisted keys, and names beyond the cap)
OTHER: Final = "other"
#: the label of the one tenant of a server without API keys
ANONYMOUS_LABEL: Final = "anonymous"
#: a named tenant's label is cut to this many characters
LABEL_CHARS: Final = 64
#: the flow prefix of a tenant a header or body field names (fleet/keys.py tenant_flow)
NAMED_PREFIX: Final = "h:"


class Tenants:
    """The rules of each flow: weight, caps, whether it may have ``priority``, its label."""

    def __init__(self, config: TenantsConfig) -> None:
        self.config = config
        self._listed: dict[str, TenantConfig] = config.by_flow()
        self._labels: dict[str, str] = {flow: t.label for flow, t in self._listed.items()}
        self._given = 0  # labels given to named tenants that are not listed

    def weight(self, flow: str) -> float:
        tenant = self._listed.get(flow)
        return self.config.default_weight if tenant is None else tenant.weight

    def max_in_flight(self, flow: str) -> int:
        """The most slots ``flow`` may hold (0: no cap but the model's)."""
        tenant = self._listed.get(flow)
        return self.config.max_in_flight if tenant is None else (
            tenant.max_in_flight or self.config.max_in_flight)

    def any_cap(self) -> bool:
        """Whether some flow may hold fewer slots than the model's limit allows."""
        return bool(self.config.max_in_flight) or any(
            tenant.max_in_flight for tenant in self._listed.values())

    def max_queue(self, flow: str) -> int:
        """The most requests of ``flow`` that may wait (0: no cap but the model's)."""
        tenant = self._listed.get(flow)
        return self.config.max_queue if tenant is None else (
            tenant.max_queue or self.config.max_queue)

    def may_use_priority(self, flow: str) -> bool:
        tenant = self._listed.get(flow)
        if tenant is None or tenant.priority is None:
            return self.config.priority
        return tenant.priority

    def tier(self, flow: str, asked: ServiceTier | None) -> Tier:
        """The tier a request of ``flow`` is served at: ``auto`` (or none asked) is
        ``default``, and ``priority`` is ``default`` for a tenant that may not have it."""
        if asked == "flex":
            return "flex"
        if asked == "priority" and self.may_use_priority(flow):
            return "priority"
        return "default"

    def label(self, flow: str) -> str:
        """What ``/metrics`` and refusals call ``flow`` (bounded: see the module's doc)."""
        label = self._labels.get(flow)
        if label is not None:
            return label
        if flow == "":
            return ANONYMOUS_LABEL
        if not flow.startswith(NAMED_PREFIX) or self._given >= self.config.max_series:
            return OTHER
        self._given += 1
        label = self._labels[flow] = flow[len(NAMED_PREFIX):][:LABEL_CHARS]
        return label

    def called(self, flow: str) -> str:
        """How a refusal names ``flow``'s tenant to its own client."""
        label = self.label(flow)
        return "this tenant" if label in (OTHER, ANONYMOUS_LABEL) else f"tenant {label!r}"


def named_in_body(tenants: TenantsConfig, tenant: str, user: str | None,
                  safety_identifier: str | None = None) -> str:
    """The tenant a request's body names, where ``[frontend.tenants] field`` says a body
    field names tenants (``user`` or ``safety_identifier``) and the body has it; else
    ``tenant`` (what its key or header gave)."""
    value = (user if tenants.field == "user"
             else safety_identifier if tenants.field == "safety_identifier" else None)
    return named_flow(value) if value else tenant
