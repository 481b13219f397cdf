"""Model families served as parts, one package each: its stage engines, its processor glue, its
tiny checkpoint's writer. omni_stage.engines.registry names them."""
