"""The rules requests run under, as one frozen snapshot the control plane publishes whole.

Like the catalog: a reload builds a new :class:`Settings` and swaps it in,
nothing is poked into live objects. A request reads the snapshot once, when
it arrives, and keeps it to its end: its admission limits, retry budget,
stall timeout, routing policy and the timeout its error message names all
come from the same reload.
"""

from __future__ import annotations

import dataclasses

from direct_frontend.fleet.schema import FrontendConfig
from direct_frontend.pipeline.admission import Admission, admission_config
from direct_frontend.pipeline.failover import FailoverConfig
from direct_frontend.pipeline.slot import AdmissionObserver
from direct_frontend.routing.policies import Policy


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """``[frontend]`` and what the data plane builds from it. Never mutated; replaced."""

    frontend: FrontendConfig
    failover: FailoverConfig
    #: the in-flight cap and queue; shared by every snapshot with the same limits
    admission: Admission
    policy: Policy

    @classmethod
    def first(cls, frontend: FrontendConfig, policy: Policy,
              observer: AdmissionObserver | None = None) -> Settings:
        """The snapshot the daemon starts with; ``observer`` hears each admitted request's
        wait for a slot, and each refusal."""
        return cls(
            frontend,
            FailoverConfig.from_fleet(frontend.faults),
            Admission(admission_config(frontend.limits), observer, frontend.tenants),
            policy,
        )

    def reloaded(self, frontend: FrontendConfig, policy: Policy | None = None) -> Settings:
        """The snapshot after a reload; ``policy`` is a new one if routing changed.

        Unchanged limits and tenants keep the running :class:`Admission`, so
        requests admitted before the reload and after it share one cap; new
        ones get a new one, and the requests admitted under the old limits
        finish under them.
        """
        admission = (
            self.admission if (frontend.limits, frontend.tenants) == (
                self.frontend.limits, self.frontend.tenants)
            else Admission(admission_config(frontend.limits), self.admission.observer,
                           frontend.tenants)
        )
        return Settings(
            frontend,
            FailoverConfig.from_fleet(frontend.faults),
            admission,
            self.policy if policy is None else policy,
        )
