"""An OpenAI-compatible HTTP endpoint in front of the `ensemble` (docs/OPENAI.md).

FastAPI + uvicorn + sse-starlette, talking to Triton over tritonclient's asyncio gRPC client:
`/v1/models`, `/v1/completions`, `/v1/chat/completions` (the target's chat template), streaming as
server-sent events, usage counts, speculation statistics in the `speculation` extension field, errors in
OpenAI's format. `python -m specdec_client.openai_api --triton-url 127.0.0.1:8001 --port 9000`.
"""
