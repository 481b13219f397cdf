"""The stage worker: one process per stage replica, running one engine between NATS and connectors."""
