"""The vLLM engine (engine.py), and the worker (worker.py) that hands a stage vLLM's hidden
states (hidden.py)."""
