"""The control plane: long-lived tasks that own engines, KV subscriptions, reloads and events.

Above the request pipeline (it publishes what the data plane reads: the
catalog and the settings) and beside the HTTP shell, which sees it only
through a small read-only protocol.
"""
