"""The `omni` command: serve, stage, gateway, models, validate."""
