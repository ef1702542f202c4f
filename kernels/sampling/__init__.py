"""The sampler's device kernels (engine/sampler.py uses them on CUDA; its torch code is their twin)."""
