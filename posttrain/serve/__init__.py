"""`posttrain serve`: an OpenAI-compatible HTTP server over posttrain's decoding engine (docs/serve.md).

scheduler.py batches requests on the engine; app.py is the HTTP API (protocol.py its wire format, chat.py the
chat template and the text of samples, generation.py one request's samples); recorder.py keeps what each episode
decoded, for training; server.py runs the app. FastAPI and uvicorn (the `serve` extra) are imported by app.py and
server.py only.
"""
