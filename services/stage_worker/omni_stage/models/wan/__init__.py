"""Wan 2.1 (text to video): its tiny checkpoint; its stages are the diffusers engine's video ones."""
