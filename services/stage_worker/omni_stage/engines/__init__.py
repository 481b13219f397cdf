"""Stage engines behind one interface (omni_stage.engines.base.Engine)."""
