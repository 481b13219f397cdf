"""omni-pipeline core: the spec, the wire format, connectors, the control plane, process lifecycle.

Every deployable (stage worker, gateway, CLI) imports this package; it imports none of them.
"""

__version__ = "0.1.0"
