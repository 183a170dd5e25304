"""Generation from a trained model: the one denoising loop (`sampler`), used by `vidray generate`, validation during
training and the serving stages. It sits above `vidray.models` (the families it samples) and below `vidray.train`
and `vidray.serve`, which call it; the diffusion maths it steps with (`vidray.diffusion`) sits below the models."""
