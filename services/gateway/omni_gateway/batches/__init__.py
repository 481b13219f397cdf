"""OpenAI's Batch API: files (/v1/files) and batches of requests run at leisure (/v1/batches)."""
