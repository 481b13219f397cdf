"""Qwen-Image-Edit (image edits): its tiny checkpoint; its stages are the diffusers engine's editing ones."""
