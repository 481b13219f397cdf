"""Video generation as jobs (/v1/videos): the job store, the runner that takes jobs up, the
files a finished job is served from, and the routes."""
