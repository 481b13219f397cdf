"""The diffusers engine: a diffusion pipeline's parts as stages (an encoder, a denoiser, a VAE
decoder), for images, videos and image edits; build.py picks a stage's engine."""
