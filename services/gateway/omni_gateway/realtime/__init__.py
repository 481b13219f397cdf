"""Live sessions: OpenAI's Realtime protocol over a WebSocket, on the gateway's pipeline API."""
