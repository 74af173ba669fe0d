"""Render a loaded fleet for people (``direct-frontend check``) and for JSON.

The text view shows every setting with its default filled in and, per engine,
which facts discovery will read from that engine kind and which the fleet
file overrides: the engine kinds differ in what they report and how far it
can be trusted, and that is the usual reason a fleet needs an override. Where
a kind reads each fact is its dialect's
(:class:`~direct_frontend.engines.dialects.base.DiscoverySources`); nothing
here knows an engine kind.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, TypeVar

from direct_frontend.engines.dialects import dialect_for
from direct_frontend.engines.dialects.base import Source
from direct_frontend.engines.neutral import EngineRole
from direct_frontend.fleet.bus import nats_auth_summary, shown_url
from direct_frontend.fleet.pools import watch_seconds
from direct_frontend.fleet.schema import (
    EFFORTS,
    AuthConfig,
    BatchesConfig,
    EngineConfig,
    FleetConfig,
    FrontendConfig,
    KubernetesConfig,
    ModelConfig,
    PoolConfig,
    ReplicasConfig,
    ResponsesConfig,
    RoutingConfig,
    TenantsConfig,
    TracingConfig,
)
from direct_frontend.observability.redact import REDACTED, redact_url

_V = TypeVar("_V")
JsonValue = None | bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"]

def describe_fleet(cfg: FleetConfig) -> str:
    """The resolved fleet as aligned text, one section for the frontend and one per engine."""
    out = [f"fleet {cfg.source}", "", "frontend"]
    out += _rows(_frontend_rows(cfg.frontend), indent=2)
    for index, model in enumerate(cfg.models, 1):
        source = " (the one model [frontend] describes)" if model.implicit else ""
        out += ["", f"model[{index}] {model.name}{source}"]
        out += _rows(_model_rows(model), indent=2)
    for index, pool in enumerate(cfg.pools, 1):
        out += ["", f"pool[{index}] {pool.name}"]
        out += _rows(_pool_rows(pool), indent=2)
    out.append("")
    if not cfg.engines:
        out.append("engines: none in the file" if cfg.pools
                   else "engines: none yet (add [[engine]] or [[pool]] tables)")
    for index, engine in enumerate(cfg.engines, 1):
        if index > 1:
            out.append("")
        out.append(f"engine[{index}] {engine.name}")
        out += _engine_lines(engine)
    return "\n".join(out)


def engine_facts(engine: EngineConfig) -> tuple[tuple[str, str], ...]:
    """Per fact, what discovery reads from this engine kind and what the fleet file overrides."""
    kind = engine.kind
    overrides: dict[str, int | str | None] = {
        "context_length": engine.context_length,
        "block_size": engine.block_size,
        "role": None if engine.role is EngineRole.BOTH else engine.role.value,
    }
    sources = dialect_for(kind).discovers
    return tuple(
        (field.name, _fact(kind, getattr(sources, field.name), overrides.get(field.name)))
        for field in dataclasses.fields(sources)
    )


def to_jsonable(cfg: FleetConfig, *, redact: bool = True) -> dict[str, JsonValue]:
    """The resolved fleet as JSON-ready data, keyed like the fleet file.

    Secrets show as ``"<redacted>"``, and so do the credentials inside URLs
    (:func:`~direct_frontend.observability.redact.redact_url`), unless
    ``redact`` is false (only for in-process comparisons such as a reload's
    diff; never print that form).
    """
    shown = redact_url if redact else _same
    frontend = cfg.frontend
    admin, auth = frontend.admin, frontend.auth
    token: JsonValue = admin.token if not redact or admin.token is None else REDACTED
    api_keys: list[JsonValue] = [key if not redact else REDACTED for key in auth.api_keys]
    probe, tracing, replicas = frontend.probe, frontend.tracing, frontend.replicas
    engines: list[JsonValue] = [_engine_json(engine) for engine in cfg.engines]
    models: list[JsonValue] = [model_json(model) for model in cfg.models]
    return {
        "source": str(cfg.source),
        "frontend": {
            "listen": frontend.listen,
            "served_model_name": frontend.served_model_name,
            "tokenizer": str(frontend.tokenizer),
            "max_body_bytes": frontend.max_body_bytes,
            "max_tokens_default": frontend.max_tokens_default,
            "default_context_length": frontend.default_context_length,
            "request_timeout_s": frontend.request_timeout_s,
            "header_timeout_s": frontend.header_timeout_s,
            "body_timeout_s": frontend.body_timeout_s,
            "log_json": frontend.log_json,
            "drain_timeout_s": frontend.drain_timeout_s,
            "allow_empty_fleet": frontend.allow_empty_fleet,
            "workers": frontend.workers or "auto",
            "routing": _routing_json(frontend.routing),
            "probe": {
                "interval_s": probe.interval_s,
                "timeout_s": probe.timeout_s,
                "failure_threshold": probe.failure_threshold,
                "success_threshold": probe.success_threshold,
                "join_timeout_s": probe.join_timeout_s,
                "read_loads": probe.read_loads,
            },
            "admin": {"enabled": admin.enabled, "token": token},
            "auth": {"api_keys": api_keys, "api_keys_env": auth.api_keys_env,
                     "api_keys_file": _optional(str, auth.api_keys_file),
                     "tenant_header": auth.tenant_header},
            "faults": {
                "max_retries": frontend.faults.max_retries,
                "max_migrations": frontend.faults.max_migrations,
                "stall_timeout_s": frontend.faults.stall_timeout_s,
                "drain_migrate_after_s": frontend.faults.drain_migrate_after_s,
                "wait_for_engine_s": frontend.faults.wait_for_engine_s,
            },
            "limits": {
                "max_in_flight": frontend.limits.max_in_flight,
                "max_queue": frontend.limits.max_queue,
                "queue_timeout_s": frontend.limits.queue_timeout_s,
                "flex_queue_timeout_s": frontend.limits.flex_queue_timeout_s,
                "flex_reserve": frontend.limits.flex_reserve,
                "preempt": frontend.limits.preempt,
                "max_preemptions": frontend.limits.max_preemptions,
            },
            "tracing": {
                "otlp_endpoint": _optional(shown, tracing.otlp_endpoint),
                "service_name": tracing.service_name,
                "sample_ratio": tracing.sample_ratio,
            },
            "replicas": _replicas_json(replicas, redact),
            "kubernetes": _plain(frontend.kubernetes),
            "responses": _responses_json(frontend.responses, redact),
            "batches": _plain(frontend.batches),
            "access_log": _plain(frontend.access_log),
            "tenants": _tenants_json(frontend.tenants),
        },
        "models": models,
        "engines": engines,
        "pools": [_plain(pool) for pool in cfg.pools],
    }


def _same(text: str) -> str:
    return text


def _optional(show: Callable[[_V], str], value: _V | None) -> str | None:
    return None if value is None else show(value)


def _plain(table: Any) -> JsonValue:
    """A flat schema table as JSON, keyed by its field names (an enum by its value)."""
    out: dict[str, JsonValue] = {}
    for field in dataclasses.fields(table):
        value = getattr(table, field.name)
        out[field.name] = value.value if isinstance(value, enum.Enum) else value
    return out


def _replicas_json(replicas: ReplicasConfig, redact: bool) -> JsonValue:
    """``[frontend.replicas]``: its secrets are never inline (variables and files are named),
    but a ``user:password@`` in the URL is."""
    out: dict[str, JsonValue] = {"nats": replicas.nats if not redact
                                 else shown_url(replicas.nats)}
    for field in dataclasses.fields(replicas):
        out.setdefault(field.name, getattr(replicas, field.name))
    return out


def _routing_json(routing: RoutingConfig) -> JsonValue:
    knobs: dict[str, JsonValue] = dict(routing.knobs)
    return {"policy": routing.policy, "knobs": knobs,
            "session_key": [source.written for source in routing.session_key],
            "session_weight": routing.session_weight,
            "cold_prefix_home": routing.cold_prefix_home}


def model_json(model: ModelConfig) -> dict[str, JsonValue]:
    """One model as JSON, keyed like its ``[[model]]`` table (``implicit``: from [frontend])."""
    sampling = model.sampling
    limits = model.limits
    aliases: list[JsonValue] = list(model.aliases)
    adapters: list[JsonValue] = [{"name": a.name, "path": a.path} for a in model.adapters]
    return {
        "name": model.name,
        "aliases": aliases,
        "tokenizer": str(model.tokenizer),
        "chat_template": None if model.chat_template is None else str(model.chat_template),
        "context_length": model.context_length,
        "owned_by": model.owned_by,
        "tool_parser": model.tool_parser,
        "reasoning_parser": model.reasoning_parser,
        "media": {
            "images": model.media.images,
            "fetch": model.media.fetch,
            "allowed_hosts": list(model.media.allowed_hosts),
            "allowed_networks": list(model.media.allowed_networks),
            "max_image_bytes": model.media.max_image_bytes,
            "max_image_pixels": model.media.max_image_pixels,
            "max_images": model.media.max_images,
            "fetch_timeout_s": model.media.fetch_timeout_s,
            "max_redirects": model.media.max_redirects,
            "engine_processing": model.media.engine_processing,
        },
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "min_p": sampling.min_p,
            "repetition_penalty": sampling.repetition_penalty,
            "max_tokens": sampling.max_tokens,
            "thinking_token_budget": sampling.thinking_token_budget,
            "effort_budgets": {effort: budget for effort in sorted(EFFORTS)
                               if (budget := sampling.effort_budgets.of(effort)) is not None},
        },
        "routing": _routing_json(model.routing),
        "limits": {
            "max_in_flight": limits.max_in_flight,
            "max_queue": limits.max_queue,
            "queue_timeout_s": limits.queue_timeout_s,
            "flex_queue_timeout_s": limits.flex_queue_timeout_s,
            "flex_reserve": limits.flex_reserve,
            "preempt": limits.preempt,
            "max_preemptions": limits.max_preemptions,
        },
        "max_adapters_per_engine": model.max_adapters_per_engine,
        "adapter": adapters,
        "implicit": model.implicit,
    }


def _engine_json(engine: EngineConfig) -> JsonValue:
    sim = engine.simulator
    simulator: JsonValue = None
    if engine.simulate:
        simulator = {
            "prefill_us_per_token": sim.prefill_us_per_token,
            "decode_us_per_token": sim.decode_us_per_token,
            "max_running": sim.max_running,
            "vocab_size": sim.vocab_size,
            "eos_probability": sim.eos_probability,
            "context_length": sim.context_length,
            "served_model_name": sim.served_model_name,
            "max_loras": sim.max_loras,
            "lora_load_ms": sim.lora_load_ms,
        }
    kv_events: list[JsonValue] = list(engine.kv_events)
    kv_replay: list[JsonValue] = list(engine.kv_replay)
    return {
        "name": engine.name,
        "url": engine.url,
        "kind": engine.kind,
        "role": engine.role.value,
        "kv_events": kv_events,
        "kv_replay": kv_replay,
        "dp_ranks": engine.dp_ranks,
        "context_length": engine.context_length,
        "block_size": engine.block_size,
        "bootstrap_port": engine.bootstrap_port,
        "simulate": engine.simulate,
        "simulator": simulator,
        "model": engine.model,
        "pool": engine.pool,
        "pod_uid": engine.pod_uid,
    }


def _fact(kind: str, source: Source, override: int | str | None) -> str:
    shown = f"{kind}: {source.where}"
    if override is not None:
        return f"{shown}; override: {override}"
    return f"{shown}; {source.advice}" if source.advice else shown


def _frontend_rows(frontend: FrontendConfig) -> list[tuple[str, str]]:
    routing, probe = frontend.routing, frontend.probe
    knobs = ", ".join(f"{key} = {_scalar(value)}" for key, value in routing.knobs.items())
    return [
        ("listen", frontend.listen),
        ("served_model_name", frontend.served_model_name),
        ("tokenizer", str(frontend.tokenizer)),
        ("max_body_bytes", f"{frontend.max_body_bytes} ({_size(frontend.max_body_bytes)})"),
        ("max_tokens_default", str(frontend.max_tokens_default)),
        ("default_context_length", str(frontend.default_context_length)),
        ("request_timeout_s", _scalar(frontend.request_timeout_s)),
        ("header_timeout_s", _scalar(frontend.header_timeout_s)),
        ("body_timeout_s", _scalar(frontend.body_timeout_s)),
        ("log_json", _scalar(frontend.log_json)),
        ("drain_timeout_s", _scalar(frontend.drain_timeout_s)),
        ("allow_empty_fleet", _scalar(frontend.allow_empty_fleet)),
        ("routing.policy", routing.policy),
        ("routing.knobs", knobs or "none"),
        ("probe.interval_s", _scalar(probe.interval_s)),
        ("probe.timeout_s", _scalar(probe.timeout_s)),
        ("probe.failure_threshold", str(probe.failure_threshold)),
        ("probe.success_threshold", str(probe.success_threshold)),
        ("probe.join_timeout_s", _scalar(probe.join_timeout_s)),
        ("probe.read_loads", _scalar(probe.read_loads)),
        ("admin.enabled", _scalar(frontend.admin.enabled)),
        ("admin.token", "set (redacted)" if frontend.admin.token else "none"),
        ("auth.api_keys", _keys_row(frontend.auth)),
        ("auth.owners", _owners_row(frontend.auth)),
        ("faults.max_retries", str(frontend.faults.max_retries)),
        ("faults.max_migrations", str(frontend.faults.max_migrations)),
        ("faults.stall_timeout_s", _scalar(frontend.faults.stall_timeout_s)),
        ("faults.drain_migrate_after_s", _scalar(frontend.faults.drain_migrate_after_s)),
        ("faults.wait_for_engine_s", _scalar(frontend.faults.wait_for_engine_s)),
        ("limits.max_in_flight", str(frontend.limits.max_in_flight)),
        ("limits.max_queue", str(frontend.limits.max_queue)),
        ("limits.queue_timeout_s", _scalar(frontend.limits.queue_timeout_s)),
        ("limits.flex", f"waits {_scalar(frontend.limits.flex_queue_timeout_s)} s, leaves "
                        f"{frontend.limits.flex_reserve_slots} slots free"),
        ("tracing", _tracing_row(frontend.tracing)),
        ("replicas", _replicas_row(frontend.replicas)),
        ("kubernetes", _kubernetes_row(frontend.kubernetes)),
        ("responses", _responses_row(frontend.responses)),
        ("batches", _batches_row(frontend.batches, frontend.responses.store)),
        ("access_log", (" ".join(frontend.access_log.fields) if frontend.access_log.enabled
                        else "off")),
        ("tenants", _tenants_row(frontend.tenants)),
    ]


def _keys_row(auth: AuthConfig) -> str:
    """How many keys, and where those not written in the file came from (never a key)."""
    if not auth.api_keys:
        return "none (open)"
    read = [f"${auth.api_keys_env}" if auth.api_keys_env else "",
            str(auth.api_keys_file) if auth.api_keys_file else ""]
    places = " and ".join(place for place in read if place)
    return f"{len(auth.api_keys)} (redacted" + (f"; read from {places})" if places else ")")


def _kubernetes_row(kube: KubernetesConfig) -> str:
    """How [[pool]] tables reach the API server (unused without pools)."""
    where = (f"kubeconfig {kube.kubeconfig}" if kube.kubeconfig is not None
             else "in-cluster service account, else $KUBECONFIG or ~/.kube/config")
    context = f", context {kube.context}" if kube.context else ""
    waits = ", wait_for_pods" if kube.wait_for_pods else ""
    return (f"{where}{context}; watch {watch_seconds(kube)} s each (dead after"
            f" {_scalar(kube.watch_silence_s)} s silent), relist every"
            f" {_scalar(kube.relist_interval_s)} s{waits}")


def _model_rows(model: ModelConfig) -> list[tuple[str, str]]:
    sampling = [
        f"{name} = {_scalar(value)}"
        for name, value in (
            ("temperature", model.sampling.temperature), ("top_p", model.sampling.top_p),
            ("top_k", model.sampling.top_k), ("min_p", model.sampling.min_p),
            ("repetition_penalty", model.sampling.repetition_penalty),
            ("max_tokens", model.sampling.max_tokens),
            ("thinking_token_budget", model.sampling.thinking_token_budget),
            *((f"effort_budgets.{effort}", model.sampling.effort_budgets.of(effort))
              for effort in sorted(EFFORTS)),
        )
        if value is not None
    ]
    knobs = ", ".join(f"{key} = {_scalar(value)}" for key, value in model.routing.knobs.items())
    adapters = ", ".join(
        a.name + (f" ({a.path})" if a.path else " (preloaded on the engines)")
        for a in model.adapters
    )
    limits = model.limits
    return [
        ("aliases", ", ".join(model.aliases) or "none"),
        ("tokenizer", str(model.tokenizer)),
        ("chat_template", "the tokenizer's" if model.chat_template is None
         else str(model.chat_template)),
        ("context_length", "what the engines report" if model.context_length is None
         else str(model.context_length)),
        ("owned_by", model.owned_by),
        ("tool_parser", model.tool_parser or "detected from the chat template"),
        ("reasoning_parser", model.reasoning_parser or "detected from the chat template"),
        ("sampling", ", ".join(sampling) or "the request's (OpenAI defaults)"),
        ("routing.policy", model.routing.policy),
        ("routing.knobs", knobs or "none"),
        ("limits", f"max_in_flight = {limits.max_in_flight}, max_queue = {limits.max_queue},"
                   f" queue_timeout_s = {_scalar(limits.queue_timeout_s)}"),
        ("adapters", adapters or "none"),
        ("max_adapters_per_engine", str(model.max_adapters_per_engine)),
        ("media", _media_row(model)),
    ]


def _media_row(model: ModelConfig) -> str:
    media = model.media
    if not media.images:
        return "images refused (images = false)"
    where = "data URLs only" if not media.fetch else (
        "http(s) from " + (", ".join(media.allowed_hosts) or "any public host")
        + ("; private networks allowed: " + ", ".join(media.allowed_networks)
           if media.allowed_networks else ""))
    return (f"images when the model directory has a processor we have; {where}; at most "
            f"{media.max_images} a request, {media.max_image_bytes} bytes and "
            f"{media.max_image_pixels} pixels each, fetched within "
            f"{_scalar(media.fetch_timeout_s)} s")


def _pool_rows(pool: PoolConfig) -> list[tuple[str, str]]:
    def port(value: int | None, annotation: str) -> str:
        fallback = "no default" if value is None else f"else {value}"
        return f"annotation {annotation}, {fallback}"

    rows = [
        ("pods", f"namespace {pool.namespace}, selector {pool.selector!r}"),
        ("kind", pool.kind), ("role", pool.role.value),
        ("model", pool.model or "what discovery reports"),
        ("port", port(pool.port, pool.port_annotation)),
        ("kv_events_port", port(pool.kv_events_port, pool.kv_events_annotation)),
        ("kv_replay_port", port(pool.kv_replay_port, pool.kv_replay_annotation)),
    ]
    rows += [(name, str(value)) for name, value in (
        ("context_length", pool.context_length), ("block_size", pool.block_size),
        ("bootstrap_port", pool.bootstrap_port)) if value is not None]
    rows.append(("engines", f"{pool.name}/<pod> at grpc://<pod IP>:<port>, each Ready pod"))
    return rows


def _tracing_row(tracing: TracingConfig) -> str:
    if tracing.otlp_endpoint is None:
        return "off"
    return (f"{redact_url(tracing.otlp_endpoint)} (service {tracing.service_name},"
            f" sampling {_scalar(tracing.sample_ratio)})")


def _responses_row(responses: ResponsesConfig) -> str:
    if not responses.store:
        return "kept: none (previous_response_id is refused)"
    per_owner = ("a fair share" if responses.max_bytes_per_owner is None
                 else f"at most {responses.max_bytes_per_owner}")
    where = {"memory": "in each process's memory",
             "sqlite": "in a SQLite file (survives restarts)",
             "postgres": "in PostgreSQL (shared by replicas)"}[responses.backend]
    return (f"kept for previous_response_id {where}: up to {responses.max_bytes} bytes "
            f"{'per process' if responses.backend == 'memory' else 'cached per process'} "
            f"({per_owner} per owner), {responses.ttl_s:g} s each; "
            f"{responses.max_background_per_owner} background at once per owner")


def _batches_row(batches: BatchesConfig, store: bool) -> str:
    if not store:
        return "none (files and batches are stored: responses.store is false)"
    return (f"files up to {batches.max_file_bytes} bytes and {batches.max_lines} lines, kept "
            f"{batches.file_ttl_s:g} s; {batches.concurrency} lines of a batch at once, "
            f"{batches.max_running} batches at once per process")


def _responses_json(responses: ResponsesConfig, redact: bool) -> JsonValue:
    """``[frontend.responses]`` as JSON; its ``dsn`` (it may hold a password) redacted."""
    out = _plain(responses)
    assert isinstance(out, dict)
    if redact and responses.dsn is not None:
        out["dsn"] = REDACTED
    return out


def _tenants_json(tenants: TenantsConfig) -> JsonValue:
    """``[frontend.tenants]`` as written (a tenant's flow is derived, and not shown)."""
    named: list[JsonValue] = [
        {"name": t.name, "api_key_env": t.api_key_env, "weight": t.weight,
         "max_in_flight": t.max_in_flight, "max_queue": t.max_queue, "priority": t.priority,
         "requests_per_minute": t.requests_per_minute,
         "tokens_per_minute": t.tokens_per_minute} for t in tenants.tenant]
    return {"header": tenants.header, "field": tenants.field,
            "default_weight": tenants.default_weight, "max_in_flight": tenants.max_in_flight,
            "max_queue": tenants.max_queue, "priority": tenants.priority,
            "max_series": tenants.max_series, "tenant": named,
            "requests_per_minute": tenants.requests_per_minute,
            "tokens_per_minute": tenants.tokens_per_minute}


def _tenants_row(tenants: TenantsConfig) -> str:
    """Who shares the admission queue fairly, the weights named, and who has ``priority``."""
    named_by = tenants.named_by
    who = f"the tenants {named_by} names" if named_by is not None else "each API key's owner"
    weights = ", ".join(f"{t.label} ×{t.weight:g}" for t in tenants.tenant)
    cap = f"; at most {tenants.max_in_flight} in flight each" if tenants.max_in_flight else ""
    queue = f"; at most {tenants.max_queue} waiting each" if tenants.max_queue else ""
    if tenants.priority:
        denied = [t.label for t in tenants.tenant if t.priority is False]
        priority = "everyone" + (f" but {', '.join(denied)}" if denied else "")
    else:
        priority = ", ".join(t.label for t in tenants.tenant if t.priority) or "no one"
    return (f"fair between {who} (weight {tenants.default_weight:g}"
            f"{'; ' + weights if weights else ''}){cap}{queue}; priority tier: {priority}"
            f"{_rates_row(tenants)}")


def _rates_row(tenants: TenantsConfig) -> str:
    """Each tenant's rate limits, and the named tenants' own (empty: none anywhere)."""
    def rates(requests: int, tokens: int) -> str:
        return " and ".join([f"{requests} requests"] * bool(requests)
                            + [f"{tokens} tokens"] * bool(tokens)) or "no limit"

    own = [f"{t.name or '$' + (t.api_key_env or '')} " + rates(
        tenants.requests_per_minute if t.requests_per_minute is None else t.requests_per_minute,
        tenants.tokens_per_minute if t.tokens_per_minute is None else t.tokens_per_minute)
        for t in tenants.tenant
        if (t.requests_per_minute, t.tokens_per_minute) != (None, None)]
    if not (tenants.requests_per_minute or tenants.tokens_per_minute or own):
        return ""
    each = rates(tenants.requests_per_minute, tenants.tokens_per_minute)
    return f"; rate limits a minute: {each} each" + (f" ({', '.join(own)})" if own else "")


def _owners_row(auth: AuthConfig) -> str:
    """Who owns stored responses: what another owner gets is a 404."""
    owner = "each API key" if auth.api_keys else "everyone, as one (no API keys)"
    if auth.tenant_header is not None:
        owner += f", narrowed by the tenant in header {auth.tenant_header}"
    return owner


def _replicas_row(replicas: ReplicasConfig) -> str:
    if replicas.nats is None:
        return "alone (shares nothing with other replicas)"
    return (f"share over {shown_url(replicas.nats)} (cluster {replicas.cluster}; "
            f"{nats_auth_summary(replicas)})")


def _engine_lines(engine: EngineConfig) -> list[str]:
    kind = f"{engine.kind}, simulated" if engine.simulate else engine.kind
    rows = [("url", engine.url), ("kind", kind), ("role", engine.role.value),
            ("model", engine.model or "what discovery reports")]
    if engine.kv_events:
        for rank, endpoint in enumerate(engine.kv_events):
            replay = f" (replay {engine.kv_replay[rank]})" if rank < len(engine.kv_replay) else ""
            rows.append((f"kv_events[rank {rank}]", endpoint + replay))
    else:
        rows.append(("kv_events", "none"))
        if engine.dp_ranks is not None:
            rows.append(("dp_ranks", f"{engine.dp_ranks} (pinned by the approximate memory)"))
    if engine.bootstrap_port is not None:
        rows.append(("bootstrap_port", str(engine.bootstrap_port)))
    lines = _rows(rows, indent=2)
    lines.append("  discovery (what the engine reports; what this file overrides)")
    lines += _rows(list(engine_facts(engine)), indent=4)
    if engine.simulate:
        sim = engine.simulator
        vocab = "from the tokenizer" if sim.vocab_size is None else str(sim.vocab_size)
        lines.append("  simulator")
        sim_rows = [
            ("prefill_us_per_token", _scalar(sim.prefill_us_per_token)),
            ("decode_us_per_token", _scalar(sim.decode_us_per_token)),
            ("max_running", str(sim.max_running)),
            ("vocab_size", vocab),
            ("eos_probability", _scalar(sim.eos_probability)),
            ("context_length", str(sim.context_length)),
            ("max_loras", f"{sim.max_loras} (load {_scalar(sim.lora_load_ms)} ms)"),
        ]
        lines += _rows(sim_rows, indent=4)
    return lines


def _rows(rows: list[tuple[str, str]], indent: int) -> list[str]:
    width = max(len(key) for key, _ in rows) + 2
    return [f"{' ' * indent}{key.ljust(width)}{value}".rstrip() for key, value in rows]


def _scalar(value: float | int | str | bool) -> str:
    """Values as the fleet file spells them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _size(count: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:g} {unit}"
    return f"{count} B"
