"""The serve plane: a Ray Serve video generation API (see `serve/serve_config.yaml`).

- `api`: HTTP (FastAPI) routes compatible with the OpenAI Videos API, request validation, bearer auth.
- `jobs`: the durable job store (sqlite + files) that outlives every replica.
- `policy`: the batch policy that sizes the denoiser's running batch from measured compute and transfer costs.
- `stages`: the deployments (text encoder, step-batched DiT denoiser, VAE decoder).
- `app`: the ingress deployment, the job runner and the application builder.
"""
