"""What every training mode needs from Keras: the optimizer hook, model serialization, the worker callbacks.

``optimizer_hooks`` (gradients taken out of Keras's compiled step), ``serialization`` (models as
``.keras`` bytes), ``callbacks`` (progress and checkpoints from inside a worker's ``fit``),
``runtime`` (the TensorFlow backend and a task's thread limits), ``held_out`` (validation rows read a batch at a
time), ``shipped_objects`` (the custom classes and functions a model needs, found on the driver and sent along).
"""
