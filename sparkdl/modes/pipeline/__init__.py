"""Pipeline model parallelism (GPipe): a chain model cut into stages (``cut``) and each stage's training step (``engine``)."""
