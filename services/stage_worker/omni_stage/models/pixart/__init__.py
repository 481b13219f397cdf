"""PixArt-Alpha (text to image): its tiny checkpoint; its stages are the diffusers engine's image ones."""
