"""`posttrain serve`: an OpenAI-compatible HTTP server over posttrain's decoding engine (docs/serve.md).

scheduler.py batches requests on the engine (requests.py: what a request asks and how its rows are sampled;
processors.py and structured.py: per-request logits processing and grammars; prefix_cache.py: kept keys and values).
app.py is the HTTP API: protocol.py its wire format, fields.py what each request field does, admission.py renders
and tokenizes prompts off the event loop, chat.py the chat template and the text of samples, generation.py one
request's samples, answers.py the log-probs of answers, errors.py the error bodies. limits.py bounds bodies, slow
clients and connections; recorder.py keeps what each episode decoded, for training; server.py runs the app.
FastAPI and uvicorn (the `serve` extra) are imported by app.py, errors.py, limits.py and server.py only.
"""
