"""The OpenAI-compatible gateway: HTTP in, requests routed to stage replicas over NATS."""
