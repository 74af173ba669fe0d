"""Durable state: stored responses and conversations in SQLite or PostgreSQL.

The SQL and its migrations are sans-Trio (:mod:`.sql`, blocking calls on a
pool of connections); :mod:`.shell` runs them on worker threads under a
capacity limiter, so no database call ever blocks the event loop.
"""
