"""`deepinfer serve`: the engine behind the OpenAI API.

  protocol.py        request bodies (pydantic, unknown fields refused) -> SamplingParams
  chat_template.py   messages -> prompt text, by the checkpoint's Jinja chat template
  served_model.py    the model served: the torch engine (as `LLM` builds it) or the
                     simulated twin (sim/twin.py)
  async_engine.py    the engine loop in its own thread; requests in and deltas out
                     through queues
  responses.py       deltas -> the API's response bodies and stream chunks
  server_metrics.py  /metrics in Prometheus text
  app.py             the FastAPI routes (auth, 400s naming fields, 503s, disconnects)

FastAPI and uvicorn (the `serve` extra) are imported only when the server starts.
"""
