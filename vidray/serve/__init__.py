"""The serve plane: a Ray Serve video generation API (see `serve/serve_config.yaml`).

- `errors`: `RequestError` (a refusal in the OpenAI error shape), `ApiLimits` and the length caps every layer checks.
- `wire`: a request body's bytes -> (fields, image): size checks, the strict JSON walk, the capped form parsers.
- `api`: the create request (`ModelSpec`, `VideoRequest`) and its validation (`parse_video_request`).
- `routes`: the FastAPI app (`build_api`) compatible with the OpenAI Videos API, bearer auth, `VideoService`.
- `jobs`: the durable job store (sqlite + files) that outlives every replica.
- `policy`: the batch policy that sizes the denoiser's running batch from measured compute and transfer costs.
- `stages`: the deployments (text encoder, step-batched DiT denoiser, VAE decoder).
- `app`: the ingress deployment, the job runner and the application builder.
"""
