"""The fleet file: what the frontend serves and which engines serve it.

``load_fleet`` reads and checks a TOML fleet file into immutable config
objects (:mod:`.schema`), reporting every problem at once as a
:class:`FleetError`; ``describe_fleet`` renders the resolved fleet for
``direct-frontend check``.
"""

from direct_frontend.fleet.describe import describe_fleet, to_jsonable
from direct_frontend.fleet.load import load_fleet, parse_fleet
from direct_frontend.fleet.problems import FleetError, FleetProblem
from direct_frontend.fleet.schema import (
    EngineConfig,
    EngineKind,
    FleetConfig,
    FrontendConfig,
    Knobs,
    KnobValue,
    KvAwareKnobs,
    ProbeConfig,
    RoutingConfig,
    RoutingPolicy,
    SimulatorConfig,
)

__all__ = [
    "EngineConfig",
    "EngineKind",
    "FleetConfig",
    "FleetError",
    "FleetProblem",
    "FrontendConfig",
    "KnobValue",
    "Knobs",
    "KvAwareKnobs",
    "ProbeConfig",
    "RoutingConfig",
    "RoutingPolicy",
    "SimulatorConfig",
    "describe_fleet",
    "load_fleet",
    "parse_fleet",
    "to_jsonable",
]
