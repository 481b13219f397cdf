"""HTTP request models of the OpenAI-compatible API (pydantic), one module per endpoint, each with
the functions that turn its request into what the pipeline gets (inputs, sampling)."""
