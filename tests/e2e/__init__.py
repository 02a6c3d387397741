"""End-to-end tier: full runs on the real pieces (the vLLM CPU server, training, the loops, real harnesses, Ray
clusters)."""
