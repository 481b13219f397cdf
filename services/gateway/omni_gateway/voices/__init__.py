"""Voices people upload: POST/GET/DELETE /v1/audio/voices, and where the voices are kept."""
