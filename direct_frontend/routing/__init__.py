"""Engine selection: the catalog snapshot, load accounting and routing policies (sans-IO)."""
